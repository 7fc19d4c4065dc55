"""Norms between a head and the residual stream whose learned gains change what composition
compares: QK-norm (Gemma-3, Qwen3, OLMo-2 normalise each query and key) and the post-attention
("sandwich") norm (Gemma-2/3, OLMo-2 normalise the attention block's output before adding it).

Each is RMSNorm: ``n(y) = y / rms(y) * g`` with a per-channel gain ``g`` (Gemma stores ``w`` and
uses ``g = 1 + w``). Its two parts act differently on the factors composition reads:

- the gain ``g`` is linear and per channel, so it folds exactly:
  ``q = n(x W_Q)`` is ``(x W_Q diag(g_q)) / rms(x W_Q)``: W_Q's columns scaled by ``g_q`` (K alike);
  the layer's output ``n(sum_h z_h W_O[h])`` is ``sum_h z_h W_O[h] diag(g_post) / rms(.)``:
  each head's W_O output channels scaled by ``g_post``;
- the ``1 / rms`` is a positive scalar per token: per query (or key) head for QK-norm (for
  OLMo-2's, which normalises all heads' queries together, one per token for the layer), and one
  per token shared by every head of the layer for the post-attention norm. A scalar changes no
  direction, so ``subspace`` is unaffected, and the ``frobenius`` and ``svd_bound`` scores, each a
  ratio of norms of the same pair's matrices, cancel it; what it changes is how strongly one
  token's query meets another's key (the attention pattern's temperature), which no weights-only
  score sees.

With gains of mean -0.36 and standard deviation 2.30 (Gemma-3-270M's post-attention norm in
layer 0, so ``1 + w`` changes sign), the raw factors point elsewhere than the model's: by
default (a model's ``norm_gains: fold``) the gains are folded; ``raw`` keeps W_Q, W_K and W_O
as stored, to compare. Either way the atlas records which norms the model has and what was done.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from compatlas.vocab import NormGains

# norm -> its weight's TransformerLens key within a block, and what its gain scales
GAIN_KEYS = {"q_norm": "attn.q_norm.weight", "k_norm": "attn.k_norm.weight", "post_attention_norm": "ln1_post.weight"}
FOLDED_INTO = {"q_norm": "W_Q columns", "k_norm": "W_K columns", "post_attention_norm": "W_O output channels"}


def _per_head(gain: torch.Tensor, heads: int, d_head: int) -> torch.Tensor:
    """A gain over one head's channels ([d_head], shared by the heads: Gemma-3, Qwen3) or over all
    heads' ([heads * d_head]: OLMo-2), as [heads, 1, d_head] to scale [heads, d_model, d_head]."""
    if gain.numel() == d_head:
        return gain.reshape(1, 1, d_head)
    if gain.numel() == heads * d_head:
        return gain.reshape(heads, 1, d_head)
    raise ValueError(f"a QK-norm gain of {gain.numel()} channels fits neither d_head {d_head} nor "
                     f"{heads} heads x d_head")


def fold_layer(t: Mapping[str, torch.Tensor], gains: Mapping[str, torch.Tensor | None], offset: bool,
               mode: NormGains) -> dict[str, torch.Tensor]:
    """One layer's ``q``, ``k``, ``v`` ([heads, d_model, d_head]) and ``o`` ([heads, d_head,
    d_model]) with the present norms' gains folded (``mode == "fold"``), else as given.
    ``offset``: the stored weight is ``w`` and the gain ``1 + w`` (Gemma)."""
    out = dict(t)
    if mode == "raw":
        return out

    def g(name: str) -> torch.Tensor | None:
        w = gains.get(name)
        return None if w is None else (1.0 + w.float() if offset else w.float())

    if (gq := g("q_norm")) is not None:
        out["q"] = t["q"] * _per_head(gq, t["q"].shape[0], t["q"].shape[2])
    if (gk := g("k_norm")) is not None:
        out["k"] = t["k"] * _per_head(gk, t["k"].shape[0], t["k"].shape[2])
    if (gp := g("post_attention_norm")) is not None:
        out["o"] = t["o"] * gp.reshape(1, 1, -1)
    return out


def read_gains(weight: Callable[[str], torch.Tensor | None], layer: int) -> dict[str, torch.Tensor | None]:
    """The layer's norm gains as stored (None where the model has no such norm); ``weight`` reads
    one TransformerLens key (``blocks.<layer>.<key>``) or returns None."""
    return {name: weight(f"blocks.{layer}.{key}") for name, key in GAIN_KEYS.items()}


def describe(present: Mapping[str, bool], mode: NormGains) -> dict[str, str]:
    """What the atlas records per norm the model has: ``folded into W_Q columns`` or ``raw``."""
    return {name: (f"folded into {FOLDED_INTO[name]}" if mode == "fold" else "raw (not folded)")
            for name, has in present.items() if has}
