"""The weight shard's file: a safetensors file written tensor by tensor, read back by byte ranges
(a job reads only its layers), and the seals that let a job check only what it reads.

``write_safetensors`` writes the format (8 bytes of header length, the JSON header, then the
tensors' bytes, no gaps); ``shard_seals`` hashes, in one streamed read, the whole file (provenance)
and each layer's and each shared piece's bytes (``seal_pieces``); ``read_layers`` and
``read_tensor`` read into a tensor's own memory and feed a digest the bytes just read.
``compatlas.models.weights.load_weights`` puts them together."""

from __future__ import annotations

import io
import json
import os
from typing import Any

import torch

from compatlas.storage import pieces_sha256


class CorruptShardError(RuntimeError):
    """A weight or result shard that cannot be read back intact."""


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """A safetensors file written tensor by tensor from the tensors' own memory.

    ``safetensors.torch.save_file`` first copies every tensor into bytes, a second copy of the
    whole shard in memory (at Llama-2-70B shapes: 4.4 GB more at the extract rule's peak). The
    format is simple: 8 bytes of little-endian header length, the JSON header (tensors in order,
    ``data_offsets`` relative to the data), padded with spaces to 8 bytes, then the bytes."""
    header: dict[str, Any] = {}
    offset = 0
    for k, t in tensors.items():
        if t.dtype not in _ST_DTYPES or not t.is_contiguous():
            raise ValueError(f"cannot write tensor {k!r} ({t.dtype}, contiguous={t.is_contiguous()})")
        n = t.numel() * t.element_size()
        header[k] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors.values():
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)  # the tensor's bytes, no copy


PER_LAYER_KEYS = ("W_Q", "W_K", "W_V", "W_O", "ln1_w")  # first dimension: layer; the order of a layer's seal
_DTYPES = {v: k for k, v in _ST_DTYPES.items()}
VOCABULARY_KEYS = ("W_E", "W_U")  # with the extras (token-space factors of W_E): what load_weights(vocabulary=False) leaves out
SEALS = "weights_seals"  # meta.json's key of the shard's per-layer seals (``shard_seals``)
MAX_HEADER = 100 << 20  # safetensors' own limit on a header: a corrupt length never makes us read the file whole


def raw_header(f: io.BufferedReader) -> bytes:
    """The bytes of a safetensors file's header: 8 bytes of little-endian length, then the JSON."""
    length = f.read(8)
    n = int.from_bytes(length, "little")
    if len(length) < 8 or n > MAX_HEADER:
        raise ValueError(f"not a safetensors file (a header of {n} bytes)")
    raw = length + f.read(n)
    if len(raw) < 8 + n:
        raise ValueError("its header is cut short")
    return raw


def shard_header(tensors_path: str | os.PathLike) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (name -> dtype, shape, data_offsets) and where its data starts:
    8 bytes of little-endian header length, the JSON header, then the tensors' bytes."""
    with open(tensors_path, "rb") as f:
        raw = raw_header(f)
    return json.loads(raw[8:]), len(raw)


def shard_n_layers(tensors_path: str | os.PathLike) -> int:
    """The number of layers of a weight shard, read from its header alone."""
    return shard_header(tensors_path)[0]["W_Q"]["shape"][0]


def tensor_names(header: dict[str, Any]) -> list[str]:
    return [k for k in header if k != "__metadata__"]


def seal_pieces(header: dict[str, Any], start: int) -> tuple[list[list[tuple[int, int]]], dict[str, list[tuple[int, int]]]]:
    """The byte ranges a weight shard is sealed by: each layer's (that layer's bytes of each
    per-layer tensor present, in ``PER_LAYER_KEYS`` order), and each shared piece's: ``header``
    (the 8 length bytes and the JSON) and every other tensor whole (W_E, W_U, ln_final_w, extras).
    Together they cover every byte of a file ``write_safetensors`` wrote (it leaves no gap)."""
    n_layers = header["W_Q"]["shape"][0]
    layers: list[list[tuple[int, int]]] = [[] for _ in range(n_layers)]
    for k in PER_LAYER_KEYS:
        if k in header:
            a, b = header[k]["data_offsets"]
            per_layer = (b - a) // n_layers
            for layer in range(n_layers):
                layers[layer].append((start + a + layer * per_layer, start + a + (layer + 1) * per_layer))
    shared = {"header": [(0, start)]}
    shared |= {k: [(start + header[k]["data_offsets"][0], start + header[k]["data_offsets"][1])]
               for k in tensor_names(header) if k not in PER_LAYER_KEYS}
    return layers, shared


def shard_seals(tensors_path: str | os.PathLike) -> tuple[str, dict[str, Any]]:
    """The whole file's sha256 and its seals (meta.json's ``SEALS``), in one streamed read of it
    (``storage.pieces_sha256``: no copy of the shard in memory): ``layers[k]`` the sha256 of layer
    k's bytes of ``layer_keys`` (those of ``PER_LAYER_KEYS`` present, in that order) concatenated;
    ``shared`` the sha256 of each shared piece (``seal_pieces``). A job checks the layers it reads
    and the shared pieces it reads, never the file whole (``load_weights``)."""
    header, start = shard_header(tensors_path)
    layers, shared = seal_pieces(header, start)
    whole, digests = pieces_sha256(tensors_path, {**{f"layer {k}": r for k, r in enumerate(layers)}, **shared})
    return whole, {"algorithm": "sha256", "layer_keys": [k for k in PER_LAYER_KEYS if k in header],
                   "layers": [digests[f"layer {k}"] for k in range(len(layers))],
                   "shared": {k: digests[k] for k in shared}}


def _fill(f: io.BufferedReader, out: torch.Tensor, at: int, digest: Any | None) -> bool:
    """Read ``out``'s bytes from ``f`` at ``at`` into its own memory (no memory map, no second
    copy), and feed them to ``digest`` (the bytes just read: never read twice). False when the
    file ends first."""
    buf = out.reshape(-1).view(torch.uint8).numpy().data
    f.seek(at)
    if f.readinto(buf) != len(buf):
        return False
    if digest is not None:
        digest.update(buf)
    return True


def read_layers(f: io.BufferedReader, header: dict[str, Any], start: int, name: str, layers: list[int],
                 digests: list[Any] | None = None) -> torch.Tensor:
    """Some layers of a per-layer tensor of the open shard ``f`` (``header`` and data ``start``
    from ``shard_header``), read into a fresh tensor with plain reads: each layer is one contiguous
    byte range, and no page of the other layers (nor a memory map of the file, which would count
    twice in the job's resident memory) is touched. ``digests[i]``, when given, takes the bytes
    of ``layers[i]``."""
    info = header[name]
    shape, dtype = info["shape"], _DTYPES[info["dtype"]]
    out = torch.empty((len(layers), *shape[1:]), dtype=dtype)
    per_layer = out[0].numel() * out.element_size()
    if info["data_offsets"][1] - info["data_offsets"][0] != per_layer * shape[0]:
        raise ValueError(f"{name}'s byte range does not fit its shape {shape}")
    for i, layer in enumerate(layers):
        if not _fill(f, out[i], start + info["data_offsets"][0] + layer * per_layer, None if digests is None else digests[i]):
            raise CorruptShardError(f"weight shard {f.name} is corrupt or truncated: {name} of layer {layer} is cut short")
    return out


def read_tensor(f: io.BufferedReader, header: dict[str, Any], start: int, name: str, digest: Any | None) -> torch.Tensor:
    """A tensor of the open shard ``f`` whole, its bytes fed to ``digest`` as they are read."""
    info = header[name]
    out = torch.empty(info["shape"], dtype=_DTYPES[info["dtype"]])
    a, b = info["data_offsets"]
    if b - a != out.numel() * out.element_size():
        raise ValueError(f"{name}'s byte range does not fit its shape {info['shape']}")
    if not _fill(f, out, start + a, digest):
        raise CorruptShardError(f"weight shard {f.name} is corrupt or truncated: {name} is cut short")
    return out
