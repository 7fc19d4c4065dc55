"""Exact token-space composition at residual-space cost (docs/math.md#token-space-exactly).

With ``W_E = Q_E R_E`` (``Q_E`` orthonormal columns), ``||W_E X W_E^T||_F = ||R_E X R_E^T||_F``
for every d_model x d_model ``X``, and singular values agree. So token space is the residual
space in the basis ``z = x R_E^-1``: transform every head once (``W_Q, W_K, W_V -> R_E W``,
``W_O -> W_O R_E^-1``) and run the unchanged kernel. Under ``x -> x T`` the factor becomes
``O^T R_E T`` for an orthogonal O, which no metric sees: token-space scores are invariant.

We take ``R_E = S V^T`` from the SVD of W_E's factor (any factor with ``W_E = Q R``, Q
orthonormal, works). It gives the condition number for free and the remedy when W_E is badly
conditioned or rank-deficient (``compat`` processing centres W_E, so its rank is d_model - 1):
singular values below ``s_max / max_condition`` are dropped. Token space is then the rank-r
space W_E can embed into, ``R = S_r V_r^T`` (r x d_model) with ``R^+ = V_r S_r^-1``: exactly
``W_E OV W_E^+`` with the pseudo-inverse, and still invariant (``W_E T`` has the same rank).
The number dropped is recorded (0 = full rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compatlas.vocab import SPACES, Space
from compatlas.weights import AttentionWeights

DEFAULT_MAX_CONDITION = 1e6
GRAM_MAX_CONDITION = 1e5  # above this, the factor comes from Householder QR (float64 accuracy)


@dataclass
class EmbeddingBasis:
    R: torch.Tensor  # [r, d_model], W_E ~= Q R over its r kept directions
    R_inv: torch.Tensor  # [d_model, r], R R_inv = I_r
    condition: float  # of W_E (before any truncation)
    n_dropped: int


def normalised_embedding(w: AttentionWeights) -> torch.Tensor:
    """Rows of W_E as the first attention norm would see them, its weight folded in."""
    E = w.W_E.double()
    norm = str(w.meta.get("norm_type", "RMS")).upper()
    if norm.startswith("LN"):
        E = E - E.mean(-1, keepdim=True)
    E = E / E.pow(2).mean(-1, keepdim=True).clamp_min(1e-30).sqrt()
    if w.ln1_w is not None:
        E = E * w.ln1_w[0].double()
    return E


def embedding_factor(W_E: torch.Tensor) -> torch.Tensor:
    """A d_model x d_model R with ``W_E = Q R`` (Q orthonormal columns): the thin QR, in float64.

    The one O(d_vocab d_model^2) step of token space, done once per model at extraction.
    Under ``x -> x T``, ``W_E T = Q (R T)``: the factor of a transformed model is ``R T``."""
    W = W_E.double()
    if W.shape[0] < W.shape[1]:
        raise ValueError(f"W_E is {tuple(W.shape)}: token space needs d_vocab >= d_model")
    # Cholesky of the Gram matrix gives the same R (up to row signs) several times faster than
    # Householder QR, but squares the condition number: use it only while that is harmless.
    L, info = torch.linalg.cholesky_ex(W.T @ W)
    if info == 0:
        s = torch.linalg.svdvals(L)
        if s[-1] > 0 and s[0] / s[-1] < GRAM_MAX_CONDITION:
            return L.T
    return torch.linalg.qr(W, mode="r").R


def embedding_basis(W_E: torch.Tensor | None = None, max_condition: float = DEFAULT_MAX_CONDITION,
                    factor: torch.Tensor | None = None) -> EmbeddingBasis:
    """R_E = S V^T and its inverse from W_E [d_vocab, d_model] (or from a factor R with
    W_E = Q R); never d_vocab x d_vocab."""
    R0 = embedding_factor(W_E) if factor is None else factor.double()
    _, S, Vh = torch.linalg.svd(R0)  # W = (Q0 U) S Vh
    condition = float(S[0] / S[-1]) if S[-1] > 0 else float("inf")
    keep = S >= S[0] / max_condition
    S, Vh = S[keep], Vh[keep]
    return EmbeddingBasis(R=S[:, None] * Vh, R_inv=Vh.T / S[None, :], condition=condition,
                          n_dropped=int((~keep).sum()))


def change_basis(w: AttentionWeights, R: torch.Tensor, R_inv: torch.Tensor) -> AttentionWeights:
    """Readers times R on the left, writers times R^-1 on the right (residual coordinates x = z R)."""
    def rd(W: torch.Tensor) -> torch.Tensor:
        return (R.to(W) @ W)

    # The vocabulary side is not carried over: the kernel never reads it, and W_E R^-1 alone
    # would cost a d_vocab x d_model^2 product per call.
    return AttentionWeights(
        W_Q=rd(w.W_Q), W_K=rd(w.W_K), W_V=rd(w.W_V), W_O=w.W_O @ R_inv.to(w.W_O),
        W_E=None, W_U=None, ln1_w=None, ln_final_w=None, meta=w.meta,
    )


def add_space_factors(w: AttentionWeights) -> None:
    """Compute each token space's factor once (at extraction) and record its condition number.

    A vocabulary smaller than d_model has no token space: recorded as None, and only the
    token-space jobs fail (with embedding_factor's message), not the extraction."""
    if w.W_E.shape[0] < w.W_E.shape[1]:
        for space in SPACES[1:]:
            w.meta[f"{space}_condition"] = None
        return
    for space in SPACES[1:]:
        R = embedding_factor(w.W_E if space == "token" else normalised_embedding(w))
        w.extras[f"R_{space}"] = R  # kept in float64: the basis change is sensitive to conditioning
        S = torch.linalg.svdvals(R)
        w.meta[f"{space}_condition"] = float(S[0] / S[-1]) if S[-1] > 0 else float("inf")


def space_factor(w: AttentionWeights, space: Space) -> torch.Tensor:
    """The factor R of the space's embedding (stored at extraction when available)."""
    if f"R_{space}" in w.extras:
        return w.extras[f"R_{space}"]
    return embedding_factor(w.W_E if space == "token" else normalised_embedding(w))


def to_space(w: AttentionWeights, space: Space, max_condition: float = DEFAULT_MAX_CONDITION) -> tuple[AttentionWeights, dict]:
    """The model's weights in the given space, plus facts about the basis (condition number...)."""
    if space == "residual":
        return w, {}
    if space not in SPACES:
        raise ValueError(f"unknown space {space!r}; choose from {SPACES}")
    basis = embedding_basis(max_condition=max_condition, factor=space_factor(w, space))
    return change_basis(w, basis.R, basis.R_inv), {
        "embedding_condition": basis.condition, "embedding_dropped": basis.n_dropped, "max_condition": max_condition,
    }
