"""The extracted attention weights of one model checkpoint: the shard every rule reads.

Extraction (``compatlas.loading``) runs once per model x checkpoint and writes a
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
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from compatlas.storage import atomic_path

WEIGHT_KEYS = ("W_Q", "W_K", "W_V", "W_O", "W_E", "W_U", "ln1_w", "ln_final_w")


class CorruptShardError(RuntimeError):
    """A weight or result shard that cannot be read back intact."""


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

    def expanded_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_K and W_V repeated to one per query head (query head h uses kv head h // group)."""
        group = self.n_heads // self.n_kv_heads
        return self.W_K.repeat_interleave(group, dim=1), self.W_V.repeat_interleave(group, dim=1)

    def layers(self, layers: list[int]) -> "AttentionWeights":
        """The same model restricted to some layers (for composition on a layer range)."""
        idx = torch.tensor(layers, dtype=torch.long)
        return AttentionWeights(
            W_Q=self.W_Q[idx], W_K=self.W_K[idx], W_V=self.W_V[idx], W_O=self.W_O[idx],
            W_E=self.W_E, W_U=self.W_U,
            ln1_w=None if self.ln1_w is None else self.ln1_w[idx],
            ln_final_w=self.ln_final_w, meta=self.meta, extras=self.extras,  # extras are per model, not per layer
        )

    def to(self, device: torch.device | str, dtype: torch.dtype) -> "AttentionWeights":
        def cast(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device=device, dtype=dtype)

        return AttentionWeights(**{k: cast(getattr(self, k)) for k in WEIGHT_KEYS}, meta=self.meta,
                                extras={k: cast(v) for k, v in self.extras.items()})


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def save_weights(w: AttentionWeights, tensors_path: str | os.PathLike, meta_path: str | os.PathLike) -> None:
    """Write the safetensors shard, then the metadata (with the shard's checksum), both atomically.

    The metadata is written last, so a shard without metadata is an unfinished one.
    """
    from safetensors.torch import save_file

    w.validate()
    tensors = {k: getattr(w, k).detach().contiguous().cpu() for k in WEIGHT_KEYS if getattr(w, k) is not None}
    tensors.update({f"extra.{k}": v.detach().contiguous().cpu() for k, v in w.extras.items()})
    with atomic_path(tensors_path) as tmp:
        save_file(tensors, str(tmp))
    meta = dict(w.meta)
    meta["weights_sha256"] = file_sha256(tensors_path)
    meta["weights_file"] = Path(tensors_path).name
    with atomic_path(meta_path) as tmp:
        Path(tmp).write_text(json.dumps(meta, indent=2, sort_keys=True))


def load_meta(meta_path: str | os.PathLike) -> dict[str, Any]:
    try:
        return json.loads(Path(meta_path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CorruptShardError(f"cannot read weight metadata {meta_path}: {e}") from e


def load_weights(tensors_path: str | os.PathLike, meta_path: str | os.PathLike, verify: bool = True) -> AttentionWeights:
    """Read a weight shard back; a truncated or altered file raises CorruptShardError naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    meta = load_meta(meta_path)
    if verify:
        digest = file_sha256(tensors_path)
        if digest != meta.get("weights_sha256"):
            raise CorruptShardError(
                f"weight shard {tensors_path} is corrupt or truncated: sha256 {digest[:12]}... "
                f"does not match {str(meta.get('weights_sha256'))[:12]}... recorded in {meta_path}; "
                "delete it and rerun the extract rule"
            )
    try:
        tensors = load_file(str(tensors_path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CorruptShardError(f"cannot read weight shard {tensors_path}: {e}") from e
    missing = [k for k in ("W_Q", "W_K", "W_V", "W_O", "W_E") if k not in tensors]  # a shard always has W_E
    if missing:
        raise CorruptShardError(f"weight shard {tensors_path} lacks {missing}")
    extras = {k.removeprefix("extra."): v for k, v in tensors.items() if k.startswith("extra.")}
    w = AttentionWeights(**{k: tensors.get(k) for k in WEIGHT_KEYS}, meta=meta, extras=extras)
    w.validate()
    return w
