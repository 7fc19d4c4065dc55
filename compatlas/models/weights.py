"""The extracted attention weights of one model checkpoint: the shard every rule reads.

Extraction (``compatlas.models.loading``) runs once per model x checkpoint and writes a
safetensors file plus JSON metadata; everything downstream reads only this.
Shapes follow TransformerLens (row vectors):

- ``W_Q``: [n_layers, n_heads, d_model, d_head]
- ``W_K``, ``W_V``: [n_layers, n_kv_heads, d_model, d_head] (grouped-query: n_kv_heads <= n_heads)
- ``W_O``: [n_layers, n_heads, d_head, d_model]
- ``W_E``: [d_vocab, d_model]; ``W_U``: [d_model, d_vocab] or absent (encoders)
- ``ln1_w``: [n_layers, d_model] weight of the norm in front of each attention layer
  (absent when the model has none or it was folded into the weights)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from compatlas.models.shard_file import (  # noqa: F401 -- CorruptShardError, shard_n_layers, write_safetensors: re-exported
    PER_LAYER_KEYS,
    SEALS,
    VOCABULARY_KEYS,
    CorruptShardError,
    raw_header,
    read_layers,
    read_tensor,
    shard_n_layers,
    shard_seals,
    tensor_names,
    write_safetensors,
)
from compatlas.runtime import library_versions
from compatlas.storage import atomic_path, file_sha256, read_sealed_json, sealed_json

log = logging.getLogger(__name__)

WEIGHT_KEYS = ("W_Q", "W_K", "W_V", "W_O", "W_E", "W_U", "ln1_w", "ln_final_w")


@dataclass
class AttentionWeights:
    W_Q: torch.Tensor
    W_K: torch.Tensor
    W_V: torch.Tensor
    W_O: torch.Tensor
    W_E: torch.Tensor | None  # None in a derived basis (token space), where the kernel needs no vocabulary side
    W_U: torch.Tensor | None = None
    ln1_w: torch.Tensor | None = None
    ln_final_w: torch.Tensor | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    # derived per-model tensors computed once at extraction (e.g. the token-space factor R_E)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    # the model's layer numbers of the per-layer tensors, when they hold only some layers
    # (``load_weights(layers=...)``); None: all layers, in order
    layer_ids: tuple[int, ...] | None = None

    @property
    def n_layers(self) -> int:
        return self.W_Q.shape[0]

    @property
    def n_heads(self) -> int:
        return self.W_Q.shape[1]

    @property
    def n_kv_heads(self) -> int:
        return self.W_K.shape[1]

    @property
    def d_model(self) -> int:
        return self.W_Q.shape[2]

    @property
    def d_head(self) -> int:
        return self.W_Q.shape[3]

    @property
    def d_vocab(self) -> int:
        if self.W_E is None:
            raise ValueError("these weights carry no W_E (a derived basis)")
        return self.W_E.shape[0]

    def validate(self) -> None:
        """Check the shapes agree with each other; raise ValueError naming the culprit."""
        L, H, d, dh = self.W_Q.shape
        Hkv = self.W_K.shape[1]
        expect = {
            "W_K": (L, Hkv, d, dh),
            "W_V": (L, Hkv, d, dh),
            "W_O": (L, H, dh, d),
        }
        for name, shape in expect.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(f"{name} has shape {got}, expected {shape}")
        if H % Hkv:
            raise ValueError(f"n_heads={H} is not a multiple of n_kv_heads={Hkv}")
        if self.W_E is not None and (self.W_E.ndim != 2 or self.W_E.shape[1] != d):
            raise ValueError(f"W_E has shape {tuple(self.W_E.shape)}, expected [d_vocab, {d}]")
        if self.W_U is not None and self.W_U.shape[0] != d:
            raise ValueError(f"W_U has shape {tuple(self.W_U.shape)}, expected [{d}, d_vocab]")
        if dh > d:
            raise ValueError(f"d_head={dh} > d_model={d}: heads are not low rank")
        for name in WEIGHT_KEYS:
            t = getattr(self, name)
            if t is not None and (bad := nonfinite(t)):
                where = self.meta.get("source_path") or self.meta.get("source_name") or self.meta.get("model", "the model")
                raise ValueError(f"{name} holds {bad} non-finite value{'s' if bad > 1 else ''} (NaN or inf) in {where}: "
                                 "no composition score from it would be a number")

    def expanded_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_K and W_V repeated to one per query head (query head h uses kv head h // group)."""
        group = self.n_heads // self.n_kv_heads
        return self.W_K.repeat_interleave(group, dim=1), self.W_V.repeat_interleave(group, dim=1)

    def layers(self, layers: list[int]) -> AttentionWeights:
        """The same model restricted to some layers (for composition on a layer range), given by
        the model's layer numbers; the result's per-layer tensors are in that order."""
        position = {layer: i for i, layer in enumerate(self.layer_ids or range(self.n_layers))}
        missing = [layer for layer in layers if layer not in position]
        if missing:
            raise ValueError(f"layers {missing} are not in these weights (they hold layers {sorted(position)})")
        idx = torch.tensor([position[layer] for layer in layers], dtype=torch.long)
        return AttentionWeights(
            W_Q=self.W_Q[idx], W_K=self.W_K[idx], W_V=self.W_V[idx], W_O=self.W_O[idx],
            W_E=self.W_E, W_U=self.W_U,
            ln1_w=None if self.ln1_w is None else self.ln1_w[idx],
            ln_final_w=self.ln_final_w, meta=self.meta, extras=self.extras,  # extras are per model, not per layer
        )

    def to(self, device: torch.device | str, dtype: torch.dtype) -> AttentionWeights:
        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype)

        def cast_optional(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else cast(t)

        return AttentionWeights(W_Q=cast(self.W_Q), W_K=cast(self.W_K), W_V=cast(self.W_V), W_O=cast(self.W_O),
                                W_E=cast_optional(self.W_E), W_U=cast_optional(self.W_U), ln1_w=cast_optional(self.ln1_w),
                                ln_final_w=cast_optional(self.ln_final_w), meta=self.meta,
                                extras={k: cast(v) for k, v in self.extras.items()}, layer_ids=self.layer_ids)


def nonfinite(t: torch.Tensor, chunk: int = 1 << 24) -> int:
    """How many elements of ``t`` are NaN or infinite, a slice at a time (a 70B model's W_E is 4 GB:
    a mask of it whole would be 1 GB more)."""
    flat = t.reshape(-1)
    return sum(int((~torch.isfinite(flat[i:i + chunk])).sum()) for i in range(0, flat.numel(), chunk))


def extracted_weights(W_Q: torch.Tensor, W_K: torch.Tensor, W_V: torch.Tensor, W_O: torch.Tensor, W_E: torch.Tensor,
                      W_U: torch.Tensor | None, ln1_w: torch.Tensor | None, ln_final_w: torch.Tensor | None, *,
                      adapter: Any, hf_config: Any, cfg: Any, processing: str, **extra: Any) -> AttentionWeights:
    """Freshly extracted weights with the metadata every extraction path records: the
    TransformerLens adapter and HF architecture, the shapes, the norm, tied embeddings, the
    processing and library versions, plus ``extra``."""
    tied = W_U is not None and W_U.shape == W_E.T.shape and torch.equal(W_U, W_E.T)
    meta = {
        "architecture": type(adapter).__name__.removesuffix("ArchitectureAdapter"),
        "hf_architecture": (getattr(hf_config, "architectures", None) or ["?"])[0],
        "n_layers": W_Q.shape[0], "n_heads": W_Q.shape[1], "n_kv_heads": W_K.shape[1],
        "d_model": W_Q.shape[2], "d_head": W_Q.shape[3], "d_vocab": W_E.shape[0],
        "norm_type": str(getattr(cfg, "normalization_type", None)), "tied_embeddings": bool(tied),
        "has_unembed": W_U is not None, "processing": processing, "versions": library_versions(), **extra,
    }
    return AttentionWeights(W_Q=W_Q, W_K=W_K, W_V=W_V, W_O=W_O, W_E=W_E, W_U=W_U, ln1_w=ln1_w,
                            ln_final_w=ln_final_w, meta=meta)


def save_weights(w: AttentionWeights, tensors_path: str | os.PathLike, meta_path: str | os.PathLike) -> None:
    """Write the safetensors shard, then the metadata (with the shard's checksum and its seals,
    ``shard_seals``), both atomically.

    The metadata is written last, so a shard without metadata is an unfinished one.
    """
    w.validate()
    tensors = {k: getattr(w, k).detach().contiguous().cpu() for k in WEIGHT_KEYS if getattr(w, k) is not None}
    tensors.update({f"extra.{k}": v.detach().contiguous().cpu() for k, v in w.extras.items()})
    with atomic_path(tensors_path, need=sum(t.numel() * t.element_size() for t in tensors.values())) as tmp:
        write_safetensors(tensors, tmp)
    meta = dict(w.meta)
    # the whole file's sha256 (provenance: what the atlas compares) and the per-layer seals (what
    # each job checks of what it reads), from one read of the file as written
    meta["weights_sha256"], meta[SEALS] = shard_seals(tensors_path)
    meta["weights_file"] = Path(tensors_path).name
    with atomic_path(meta_path) as tmp:
        Path(tmp).write_text(sealed_json(meta))


def load_meta(meta_path: str | os.PathLike) -> dict[str, Any]:
    """A metadata file (``storage.read_sealed_json``: unchanged since written, in its model's folder);
    CorruptShardError naming it, and what to delete, where it is not."""
    try:
        return read_sealed_json(meta_path)
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        raise CorruptShardError(f"cannot trust metadata {meta_path}: {e}; delete {Path(meta_path).parent} "
                                "and rerun snakemake to remake it") from e


def _whole_file_check(tensors_path: str | os.PathLike, meta: dict[str, Any], meta_path: str | os.PathLike) -> None:
    digest = file_sha256(tensors_path)
    if digest != meta.get("weights_sha256"):
        raise CorruptShardError(
            f"weight shard {tensors_path} is corrupt or truncated: sha256 {digest[:12]}... "
            f"does not match {str(meta.get('weights_sha256'))[:12]}... recorded in {meta_path}; "
            "delete it and rerun the extract rule"
        )


def _unsealed(tensors_path: str | os.PathLike, meta_path: str | os.PathLike, layers: list[int],
              shared: list[str]) -> CorruptShardError:
    """The error naming what failed its seal: the layers, the shared pieces."""
    what = ([f"layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))}"] if layers else []) + \
        ["its header" if k == "header" else k for k in shared]
    n = len(layers) + len(shared)
    return CorruptShardError(
        f"weight shard {tensors_path} is corrupt or truncated: the bytes of {' and '.join(what)} do not match "
        f"{'their seals' if n > 1 else 'the seal'} recorded in {meta_path}; delete {tensors_path} and rerun the "
        "extract rule")


def load_weights(tensors_path: str | os.PathLike, meta_path: str | os.PathLike, verify: bool = True,
                 layers: list[int] | None = None, vocabulary: bool = True) -> AttentionWeights:
    """Read a weight shard back; a truncated or altered file raises CorruptShardError naming it.

    With ``layers``, only those layers' attention tensors are read (``read_layers``): a
    composition job at Llama-2-70B shapes holds the few layers its block touches (0.6 GB each in
    float32) instead of all 80 (47 GiB). ``vocabulary=False`` leaves out W_E, W_U and the extras
    (the token-space factors of W_E; 4 GB at 70B), which the residual and activation spaces never
    read. The other per-model tensors are read whole.

    ``verify`` checks what is read, as it is read, against the seals meta.json records
    (``shard_seals``): the header, each layer read, each shared tensor read; a flipped byte in
    layer k fails exactly the loads that read layer k, naming it. Reading it all checks every
    byte, in the same single pass. Metadata written before the seals: the whole file's sha256."""
    meta = load_meta(meta_path)
    seals = meta.get(SEALS) if verify else None
    if verify and seals is None:
        log.info("weight shard %s: %s records no per-layer seals (written before them): checking the whole "
                 "file's sha256 instead", tensors_path, meta_path)
        _whole_file_check(tensors_path, meta, meta_path)
    try:
        opened = open(tensors_path, "rb")
    except OSError as e:
        raise CorruptShardError(f"cannot read weight shard {tensors_path}: {e}") from e
    with opened as f:
        try:
            raw = raw_header(f)
            if seals is not None and hashlib.sha256(raw).hexdigest() != seals["shared"].get("header"):
                raise _unsealed(tensors_path, meta_path, [], ["header"])
            header, start = json.loads(raw[8:]), len(raw)
            names = tensor_names(header)
            missing = [k for k in ("W_Q", "W_K", "W_V", "W_O", "W_E") if k not in names]  # a shard always has W_E
            if missing:
                raise CorruptShardError(f"weight shard {tensors_path} lacks {missing}")
            size, end = os.fstat(f.fileno()).st_size, start + max(header[k]["data_offsets"][1] for k in names)
            n_layers = header["W_Q"]["shape"][0]
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:  # json.JSONDecodeError: a ValueError
            raise CorruptShardError(f"cannot read weight shard {tensors_path}: {e}") from e
        if seals is not None and size != end:  # a stat: truncated or grown, whichever layers a job reads
            raise CorruptShardError(f"weight shard {tensors_path} is corrupt or truncated: {size} bytes, its "
                                    f"header says {end}; delete it and rerun the extract rule")
        ids = list(range(n_layers)) if layers is None else list(layers)
        if outside := [layer for layer in ids if not 0 <= layer < n_layers]:
            raise ValueError(f"layers {outside} are not in weight shard {tensors_path} (it holds {n_layers})")
        layer_digests = [hashlib.sha256() for _ in ids] if seals is not None else None
        shared_digests: dict[str, Any] = {}
        try:
            # per-layer tensors in PER_LAYER_KEYS order: each layer's digest takes its bytes in the seal's order
            tensors = {k: read_layers(f, header, start, k, ids, layer_digests) for k in PER_LAYER_KEYS if k in header}
            for k in names:
                if k in PER_LAYER_KEYS or (not vocabulary and (k in VOCABULARY_KEYS or k.startswith("extra."))):
                    continue
                digest = shared_digests[k] = hashlib.sha256() if seals is not None else None
                tensors[k] = read_tensor(f, header, start, k, digest)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CorruptShardError(f"cannot read weight shard {tensors_path}: {e}") from e
    if seals is not None and layer_digests is not None:
        bad_layers = sorted({layer for layer, d in zip(ids, layer_digests, strict=True)
                             if d.hexdigest() != seals["layers"][layer]})
        bad_shared = [k for k, d in shared_digests.items() if d.hexdigest() != seals["shared"].get(k)]
        if bad_layers or bad_shared:
            raise _unsealed(tensors_path, meta_path, bad_layers, bad_shared)
    extras = {k.removeprefix("extra."): v for k, v in tensors.items() if k.startswith("extra.")}
    w = AttentionWeights(W_Q=tensors["W_Q"], W_K=tensors["W_K"], W_V=tensors["W_V"], W_O=tensors["W_O"],
                         W_E=tensors.get("W_E"), W_U=tensors.get("W_U"), ln1_w=tensors.get("ln1_w"),
                         ln_final_w=tensors.get("ln_final_w"), meta=meta, extras=extras,
                         layer_ids=None if layers is None else tuple(layers))
    w.validate()
    return w
