"""The ``activation`` space: composition scored on the model's own activation statistics
(``compatlas.composition.moments``) instead of an isotropic residual stream (docs/math.md#contribution-and-the-activation-space).

Writer u (layer l1) adds ``z_u W_O^u`` to the residual stream; reader v (layer l2 > l1) sees it
through its attention-input norm, linearised at its mean slope ``D_l2 = diag(gain) * E[1/rms]``
(the stream centred first under LayerNorm). Over the sample, with ``Z_u = E[z_u^T z_u]``, the query and key
moments ``Q_v``, ``K_v`` and the attention scale s, the RMS of what u adds to v's logit or output:

- K: ``|| Z_u^1/2 W_O^u D_l2 W_K^v Q_v^1/2 ||_F / s``  (the key moves; over the queries that meet it)
- Q: ``|| Z_u^1/2 W_O^u D_l2 W_Q^v K_v^1/2 ||_F / s``  (the query moves; over the keys it meets)
- V: ``|| Z_u^1/2 W_O^u D_l2 W_V^v W_O^v ||_F``         (the value moves; v's output before its pattern)

That is the composition kernel unchanged, given the reader's map ``A = D_l2 W`` (W_Q scaled by
1/s) and, for the two d_head x d_head Gram matrices the kernel factors (``R^T R``), measured
moments instead of weights' Grams: the writer's ``Z_u`` for ``W_V^T W_V``, ``K_v`` (Q) or
``Q_v / s^2`` (K) for the reader's other side. Residual space is the same formula with every
moment the identity and ``D = I`` (weights only).

Change of basis: q, k, v and z do not change under ``x -> x T`` (with no norm: W_O -> W_O T,
W_Q -> T^-1 W_Q), so the Q and K contributions, changes of a logit (a number), are the same for
any invertible T. A V contribution is the length of a residual-stream vector: the same under an
orthogonal T, times s under ``x -> s x O`` (every V edge alike: their order holds), and not kept
by a general T, which is no symmetry of a model with norms anyway.

QK-norm and the post-attention ("sandwich") norm: their gains are in the weights (extraction
folds them); their per-token 1/rms enters at its mean, per head (QK-norm: ``q_inv_rms``,
``k_inv_rms``) or per layer (the writer's ``out_inv_rms``); the moments are of the normalised q
and k, which is what the logit is made of.
"""

from __future__ import annotations

from typing import Literal

import torch

from compatlas.composition.moments import Moments
from compatlas.models.weights import AttentionWeights
from compatlas.vocab import Comp

WriterStatistics = Literal["output", "input"]
"""What a writer's moment is: its measured output ``E[z^T z]`` (its attention pattern in), or its
input statistics pushed through W_V, ``E[v^T v]`` (the pattern ignored)."""


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Per-KV-head [L, Hkv, ...] as per query head [L, H, ...]."""
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def activation_weights(w: AttentionWeights, m: Moments, writer: WriterStatistics = "output"
                       ) -> tuple[AttentionWeights, dict[str, torch.Tensor], dict[Comp, torch.Tensor], dict]:
    """The weights in activation coordinates, the kernel's Gram matrices, each reader head's own
    logit (Q, K) or output (V) RMS [L, H] on the same statistics, and facts for provenance.

    ``w`` and ``m`` hold the same layers, in the same order."""
    if m.query.shape[0] != w.n_layers:
        raise ValueError(f"moments of {m.query.shape[0]} layers for weights of {w.n_layers}")
    dt, dev = w.W_Q.dtype, w.W_Q.device
    mo = {k: getattr(m, k).to(dev, dt) for k in ("query", "key", "value", "z", "inv_rms", "q_inv_rms", "k_inv_rms",
                                                 "out_inv_rms")}
    H, s = w.n_heads, m.attn_scale
    gain = w.ln1_w.to(dt) if w.ln1_w is not None else torch.ones(w.n_layers, w.d_model, dtype=dt, device=dev)
    D = (mo["inv_rms"][:, None] * gain)[:, None, :, None]  # [L, 1, d_model, 1]: scales a reader's rows
    centre = str(w.meta.get("norm_type", "RMS")).upper().startswith("LN")

    def reads(W: torch.Tensor) -> torch.Tensor:
        """A reader's map from the residual stream: LayerNorm reads ``x P`` (P = I - 11^T / d, the
        centring; ``P W`` is W minus its mean over d_model), then its slope D."""
        return D * (W - W.mean(-2, keepdim=True) if centre else W)

    W_O = w.W_O * mo["out_inv_rms"][:, None, None, None]
    wa = AttentionWeights(W_Q=reads(w.W_Q) * mo["q_inv_rms"][:, :, None, None] / s,
                          W_K=reads(w.W_K) * mo["k_inv_rms"][:, :, None, None], W_V=reads(w.W_V), W_O=W_O,
                          W_E=None, meta=w.meta, layer_ids=w.layer_ids)
    writer_gram = mo["z"] if writer == "output" else _expand(mo["value"], H)
    grams = {"writer": writer_gram, "Q": mo["key"], "K": mo["query"] / s**2}
    own_qk = torch.einsum("lhij,lhji->lh", mo["query"], _expand(mo["key"], H)).clamp_min(0).sqrt() / s
    own_v = torch.einsum("lhij,lhji->lh", _expand(mo["value"], H), W_O @ W_O.transpose(-2, -1)).clamp_min(0).sqrt()
    own: dict[Comp, torch.Tensor] = {"Q": own_qk, "K": own_qk, "V": own_v}
    facts = {"activation_writer": writer, "attn_scale": s, "moments_positions": m.meta.get("positions"),
             "moments_text": m.meta.get("text")}
    return wa, grams, own, facts

