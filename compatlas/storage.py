"""Atomic writes, Parquet shards with provenance, and their content checksums.

Every file compatlas produces is written to a temporary name in the same folder and
renamed into place, so a killed job leaves either the old file or none, never half a shard; and
only while the job's run still holds the results folder (``runlock.check_current``), so a job
left behind by a killed run never replaces the next run's file.

Every shard is sealed: the sha256 of its bytes is written beside it (``<shard>.sha256``, in
``sha256sum`` format, so ``sha256sum -c`` checks it too) before the shard is renamed into place,
and ``shard_error`` verifies it before a shard's numbers reach a job, a view or a query. A
footer check alone misses a flipped byte in a data page (a wrong score, silently); the whole
file's hash misses nothing. A shard that fails is set aside under ``results/quarantine/``
(``set_aside``), never deleted, and the pipeline remakes it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from compatlas.runlock import check_current
from compatlas.tables import nonfinite_counts


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """The sha256 of a file's bytes, read in chunks (weight shards, GGUF files, checkpoints)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def pieces_sha256(path: str | os.PathLike, pieces: Mapping[str, Sequence[tuple[int, int]]],
                  chunk: int = 1 << 22) -> tuple[str, dict[str, str]]:
    """The sha256 of a file's bytes and of each named piece of it (``pieces``: name -> its byte
    ranges ``[start, end)``, ascending, hashed in that order), all in one streamed read: the
    weight shard's per-layer seals are computed from the written file without a second pass over
    it nor a copy of it in memory. Pieces may overlap each other; ValueError where a piece's own
    ranges are not ascending, and where one reaches past the end of the file."""
    segments: list[tuple[int, int, str]] = []
    for name, ranges in pieces.items():
        last = 0
        for a, b in ranges:
            if not last <= a <= b:
                raise ValueError(f"piece {name!r}: its byte ranges are not ascending and disjoint at [{a}, {b})")
            segments.append((a, b, name))
            last = b
    segments.sort(key=lambda s: s[0])
    whole, digests = hashlib.sha256(), {name: hashlib.sha256() for name in pieces}
    active: list[tuple[int, int, str]] = []
    nxt, pos = 0, 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            whole.update(block)
            end, view = pos + len(block), memoryview(block)
            while nxt < len(segments) and segments[nxt][0] < end:
                active.append(segments[nxt])
                nxt += 1
            for a, b, name in active:
                if b > pos and a < end:
                    digests[name].update(view[max(a, pos) - pos:min(b, end) - pos])  # a view: no copy
            active = [s for s in active if s[1] > end]
            pos = end
    if past := [name for a, b, name in segments if b > pos]:
        raise ValueError(f"{path} is {pos} bytes: pieces {sorted(set(past))} reach past its end")
    return whole.hexdigest(), {name: h.hexdigest() for name, h in digests.items()}


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, need: int | None = None) -> Iterator[Path]:
    """Yield a temp path next to ``path``; on success fsync and rename it over ``path``. A full
    disk is an error naming ``path`` and the space: ``need`` bytes where the caller knows them."""
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
        check_current(path)  # a job left behind by its run writes nothing (compatlas.runlock)
        os.replace(tmp_path, path)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        # name the file and the space: "No space left on device" alone says neither
        written = tmp_path.stat().st_size if tmp_path.exists() else 0
        free = shutil.disk_usage(path.parent).free
        needs = f"{need / 1e6:.1f} MB" if need else f"more than the {written / 1e6:.1f} MB written before the disk filled"
        raise OSError(errno.ENOSPC, f"no space left on device writing {path}: it needs {needs} ({free / 1e6:.1f} MB "
                      f"free in {path.parent}); free space and rerun") from e
    finally:
        tmp_path.unlink(missing_ok=True)


CHECKSUM_SUFFIX = ".sha256"
QUARANTINE = "quarantine"  # the folder under results/ where shards that fail their checksum are set aside


def checksum_path(path: str | os.PathLike) -> Path:
    """The sidecar holding a shard's sha256: ``block=0.parquet`` -> ``block=0.parquet.sha256``."""
    p = Path(path)
    return p.with_name(p.name + CHECKSUM_SUFFIX)


def seal(tmp: Path, path: str | os.PathLike) -> None:
    """Write the sha256 of ``tmp`` (the shard about to be renamed to ``path``) beside ``path``.
    Written first: a job killed between the two renames leaves a checksum that the old shard
    fails, so that shard is remade rather than trusted."""
    with atomic_path(checksum_path(path)) as side:
        side.write_text(f"{file_sha256(tmp)}  {Path(path).name}\n")


def shard_error(path: str | os.PathLike) -> str | None:
    """Why a shard cannot be trusted (missing, no checksum, content changed since it was
    written, not a whole Parquet file), or None when it is as written."""
    import pyarrow.parquet as pq

    p = Path(path)
    if not p.is_file():
        return "missing"
    side = checksum_path(p)
    if not side.is_file():
        return f"no checksum beside it ({side.name}): written before shards were sealed, or the checksum was lost"
    expected = side.read_text().split()[:1]
    actual = file_sha256(p)
    if expected != [actual]:
        return f"content does not match its checksum ({side.name}: sha256 {''.join(expected)[:12]}..., the file {actual[:12]}...)"
    try:
        md = pq.read_metadata(p)
    except Exception as e:  # noqa: BLE001 -- sealed but not Parquet: the writer itself was wrong
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return identity_error(p, json.loads((md.metadata or {}).get(b"compatlas", b"{}")))


# The keys of a shard's path (``.../model=m/checkpoint=c/metric=x/space=s/...``) that its provenance
# records too: a sealed shard whose record says otherwise was copied or moved from another folder.
PATH_KEYS = ("model", "checkpoint", "metric", "space")


def identity_error(path: str | os.PathLike, record: Mapping[str, Any]) -> str | None:
    """Why a shard (or metadata file) is not what its path says, or None: each of ``PATH_KEYS``
    that both its path and its provenance ``record`` name must agree."""
    wrong = []
    for key in PATH_KEYS:
        try:
            named = path_key(path, key)
        except ValueError:
            continue
        if key in record and record[key] is not None and str(record[key]) != named:
            wrong.append(f"{key}={record[key]} (its path: {key}={named})")
    return (f"its provenance says {', '.join(wrong)}: a file copied or moved from another folder" if wrong else None)


# A metadata file (weights' meta.json, moments.json) carries the sha256 of its own content, every
# other key in canonical JSON: an edit by hand (moments.json's attn_scale 4.0 -> 5.0 changed every
# activation-space score with exit 0) then fails the check instead of feeding the scores.
CONTENT_SHA256 = "content_sha256"


def _canonical(record: Mapping[str, Any]) -> bytes:
    return json.dumps({k: v for k, v in record.items() if k != CONTENT_SHA256}, sort_keys=True).encode()


def sealed_json(record: Mapping[str, Any]) -> str:
    """``record`` as the JSON text of a metadata file, with ``CONTENT_SHA256`` added."""
    return json.dumps({**record, CONTENT_SHA256: hashlib.sha256(_canonical(record)).hexdigest()}, indent=2, sort_keys=True)


def read_sealed_json(path: str | os.PathLike) -> dict[str, Any]:
    """A metadata file written by ``sealed_json``: ValueError naming it when its content changed
    since (a file written before the seal, without ``CONTENT_SHA256``, is read as it is); and when
    it sits in ``<kind>/<model>/<checkpoint>/`` (weights, moments), its model and checkpoint must be
    those folders'."""
    p = Path(path)
    record = json.loads(p.read_text())
    if CONTENT_SHA256 in record and record[CONTENT_SHA256] != hashlib.sha256(_canonical(record)).hexdigest():
        raise ValueError(f"{p} was changed after it was written (its {CONTENT_SHA256} no longer matches its content)")
    if p.parent.parent.parent.name in ("weights", "moments"):
        named = {"model": p.parent.parent.name, "checkpoint": p.parent.name}
        wrong = [f"{k}={record[k]} (its folder: {v})" for k, v in named.items() if record.get(k) not in (None, v)]
        if wrong:
            raise ValueError(f"{p} says {', '.join(wrong)}: copied or moved from another model's folder")
    return record


def bad_shards(paths: Iterable[str | os.PathLike]) -> dict[str, str]:
    """path -> why, for every shard of ``paths`` that ``shard_error`` does not pass."""
    return {str(p): err for p in paths if (err := shard_error(p)) is not None}


def set_aside(path: str | os.PathLike, results: str | os.PathLike) -> Path | None:
    """Move a bad shard (and its checksum) to ``results/quarantine/<its path under results>.<UTC
    time>``, keeping it for inspection: the pipeline then sees the shard missing and remakes it.
    Returns where it went (None if it was already gone)."""
    p, root = Path(path).resolve(), Path(results).resolve()
    if not p.exists():
        return None
    rel = p.relative_to(root) if p.is_relative_to(root) else Path(p.name)
    target = root / QUARANTINE / rel.parent / f"{rel.name}.{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    n = 1
    while target.exists():  # set aside twice in one second: keep both
        target, n = target.with_name(f"{target.name.split('~')[0]}~{n}"), n + 1
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(p, target)
    if checksum_path(p).exists():
        os.replace(checksum_path(p), checksum_path(target))
    return target


def remove_leftover_temps(results: str | os.PathLike) -> list[Path]:
    """Delete the temporary files (``.<name>.*.tmp``, ``atomic_path``'s) that killed jobs left
    under ``results``. Only safe while no job writes there: the run lock's holder, before its jobs."""
    root = Path(results)
    # (.tmp.wal: DuckDB's log beside an atlas being built)
    gone = [p for pat in (".*.tmp", ".*.tmp.wal") for p in root.rglob(pat) if p.is_file()] if root.is_dir() else []
    for p in gone:
        p.unlink(missing_ok=True)
    return gone


class NonFiniteShard(ValueError):
    """A shard about to be sealed holds NaN or inf where a number must be (``tables.MUST_BE_FINITE``)."""


def refuse_nonfinite(df: pl.DataFrame, path: str | os.PathLike) -> None:
    """NonFiniteShard naming ``path``, the columns and the counts, where ``df`` holds NaN or inf in a
    column that must hold numbers; nothing is written then."""
    if bad := nonfinite_counts(df):
        what = ", ".join(f"{c} holds {n:,} NaN or infinite value{'s' if n > 1 else ''}" for c, n in bad.items())
        raise NonFiniteShard(f"refusing to seal {path}: {what} (of {df.height:,} rows); such a number comes only from "
                             "non-finite inputs (the model's weights or activations): see the job's log")


def write_shard(df: pl.DataFrame, path: str | os.PathLike, provenance: dict[str, Any]) -> None:
    """Write one Parquet shard atomically, with provenance in the file's key-value metadata; never
    a shard with NaN or inf where a number must be (``refuse_nonfinite``)."""
    refuse_nonfinite(df, path)
    with atomic_path(path) as tmp:
        df.write_parquet(tmp, compression="zstd", metadata={"compatlas": json.dumps(provenance, sort_keys=True)})
        seal(tmp, path)


def write_shard_parts(parts: Iterable[pl.DataFrame], path: str | os.PathLike, provenance: dict[str, Any],
                      schema: Mapping[str, pl.DataType | type[pl.DataType]]) -> int:
    """Write frames one row group at a time into one Parquet shard (atomically, with provenance),
    so a large table never sits in memory whole. Returns the number of rows."""
    import pyarrow.parquet as pq

    arrow_schema = pl.DataFrame(schema=schema).to_arrow().schema
    arrow_schema = arrow_schema.with_metadata({"compatlas": json.dumps(provenance, sort_keys=True)})
    dtypes = pl.Schema(schema)  # what cast's signature takes (a dict of dtype classes is not, to the type checker)
    rows = 0
    with atomic_path(path) as tmp:
        with pq.ParquetWriter(tmp, arrow_schema, compression="zstd") as writer:
            for df in parts:
                df = df.select(list(schema)).cast(dtypes)
                refuse_nonfinite(df, path)
                writer.write_table(df.to_arrow().cast(arrow_schema))
                rows += df.height
        seal(tmp, path)
    return rows


def path_key(path: str | os.PathLike, key: str) -> str:
    """The value of a hive-style ``key=value`` folder (or file stem) of a shard's path: ``metric``
    of ``.../metric=frobenius/space=residual/block=0.parquet`` is ``frobenius``."""
    for part in Path(path).with_suffix("").parts[::-1]:
        name, sep, value = part.partition("=")
        if sep and name == key:
            return value
    raise ValueError(f"{path}: no {key}=... in the path")


def read_provenance(path: str | os.PathLike) -> dict[str, Any]:
    import pyarrow.parquet as pq

    md = pq.read_metadata(path).metadata or {}
    raw = md.get(b"compatlas")
    return json.loads(raw) if raw else {}


class BadShard(RuntimeError):
    """A shard a job was about to read failed ``shard_error``; the message names it in one line."""


def read_shard(path: str | Path) -> tuple[pl.DataFrame, dict[str, Any]]:
    """A shard's rows and its provenance (``write_shard``'s), for a job that merges other jobs' shards."""
    return pl.read_parquet(path), read_provenance(path)


def check_shards(paths: list[str | os.PathLike], results: str | os.PathLike | None = None) -> None:
    """Verify every shard a job reads (checksum and footer); on the first bad one, set it aside
    under ``results`` (when given) and raise naming it, so that the next run remakes it."""
    for p in paths:
        if (err := shard_error(p)) is not None:
            where = set_aside(p, results) if results is not None and err != "missing" else None
            moved = f"; set aside as {where}" if where else ""
            raise BadShard(f"result shard {p} is corrupt or truncated ({err}){moved}; rerun snakemake to remake it")


def dir_checksum(folder: Path) -> str:
    """sha256 over the weight files of a save_pretrained directory (names and contents)."""
    h = hashlib.sha256()
    for p in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        h.update(p.name.encode())
        h.update(file_sha256(p).encode())
    return h.hexdigest()
