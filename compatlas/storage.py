"""Atomic writes and Parquet shards with provenance.

Every file compatlas produces is written to a temporary name in the same folder and
renamed into place, so a killed job leaves either the old file or none, never half a shard.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import polars as pl


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """The sha256 of a file's bytes, read in chunks (weight shards, GGUF files, checkpoints)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path next to ``path``; on success fsync and rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; results are shared on a cluster
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    finally:
        tmp_path.unlink(missing_ok=True)


def write_shard(df: pl.DataFrame, path: str | os.PathLike, provenance: dict[str, Any]) -> None:
    """Write one Parquet shard atomically, with provenance in the file's key-value metadata."""
    with atomic_path(path) as tmp:
        df.write_parquet(tmp, compression="zstd", metadata={"compatlas": json.dumps(provenance, sort_keys=True)})


def write_shard_parts(parts: Iterable[pl.DataFrame], path: str | os.PathLike, provenance: dict[str, Any],
                      schema: dict[str, pl.DataType]) -> int:
    """Write frames one row group at a time into one Parquet shard (atomically, with provenance),
    so a large table never sits in memory whole. Returns the number of rows."""
    import pyarrow.parquet as pq

    arrow_schema = pl.DataFrame(schema=schema).to_arrow().schema
    arrow_schema = arrow_schema.with_metadata({"compatlas": json.dumps(provenance, sort_keys=True)})
    rows = 0
    with atomic_path(path) as tmp:
        with pq.ParquetWriter(tmp, arrow_schema, compression="zstd") as writer:
            for df in parts:
                writer.write_table(df.select(list(schema)).cast(schema).to_arrow().cast(arrow_schema))
                rows += df.height
    return rows


def read_provenance(path: str | os.PathLike) -> dict[str, Any]:
    import pyarrow.parquet as pq

    md = pq.read_metadata(path).metadata or {}
    raw = md.get(b"compatlas")
    return json.loads(raw) if raw else {}


def check_shards(paths: list[str | os.PathLike]) -> None:
    """Open the footer of every shard; raise naming the first one that is not a whole Parquet file."""
    import pyarrow.parquet as pq

    for p in paths:
        try:
            pq.read_metadata(p)
        except Exception as e:  # pyarrow raises several types for truncated files
            raise RuntimeError(f"result shard {p} is corrupt or truncated ({e}); delete it and rerun") from e


def dir_checksum(folder: Path) -> str:
    """sha256 over the weight files of a save_pretrained directory (names and contents)."""
    h = hashlib.sha256()
    for p in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        h.update(p.name.encode())
        h.update(file_sha256(p).encode())
    return h.hexdigest()
