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
from itertools import pairwise

import torch

from compatlas.models.weights import AttentionWeights
from compatlas.vocab import TOKEN_SPACES, WEIGHT_SPACES, Space

DEFAULT_MAX_CONDITION = 1e6
GRAM_MAX_CONDITION = 1e5  # above this, the factor comes from Householder QR (float64 accuracy)
GRAM_ROWS = 2048  # rows of W_E per float64 chunk of its Gram matrix: W_E is never copied whole to float64
GRAM_BLOCKS = 4  # column blocks of the Gram matrix: its upper triangle costs (k + 1) / 2k of the product


@dataclass
class EmbeddingBasis:
    R: torch.Tensor  # [r, d_model], W_E ~= Q R over its r kept directions
    R_inv: torch.Tensor  # [d_model, r], R R_inv = I_r
    condition: float  # of W_E (before any truncation)
    n_dropped: int


def _vocabulary(w: AttentionWeights) -> torch.Tensor:
    """w's W_E; weights already in a derived basis carry none, and have no token space of their own."""
    if w.W_E is None:
        raise ValueError("these weights carry no W_E (a derived basis): token space needs the model's own")
    return w.W_E


def _row_normaliser(w: AttentionWeights):
    """Rows of W_E (a float64 chunk of them) as the first attention norm would see them, its weight folded in."""
    centre = str(w.meta.get("norm_type", "RMS")).upper().startswith("LN")
    gain = w.ln1_w[0].double() if w.ln1_w is not None else None

    def rows(E: torch.Tensor) -> torch.Tensor:
        if centre:
            E = E - E.mean(-1, keepdim=True)
        E = E / E.pow(2).mean(-1, keepdim=True).clamp_min(1e-30).sqrt()
        return E * gain if gain is not None else E
    return rows


def normalised_embedding(w: AttentionWeights) -> torch.Tensor:
    """Rows of W_E as the first attention norm would see them, its weight folded in."""
    return _row_normaliser(w)(_vocabulary(w).double())


def embedding_gram(W_E: torch.Tensor, rows=None, chunk: int = GRAM_ROWS) -> torch.Tensor:
    """``W^T W`` in float64 for ``W = rows(W_E)`` (W_E itself without ``rows``), accumulated over
    chunks of rows: the float64 copy of a 32k x 8192 W_E alone would be 2.1 GB."""
    d = W_E.shape[1]
    G = torch.zeros(d, d, dtype=torch.float64, device=W_E.device)
    # G is symmetric: only its block rows right of the diagonal are multiplied (5/8 of it), then mirrored
    cuts = [d * k // GRAM_BLOCKS for k in range(GRAM_BLOCKS + 1)]
    blocks = [(a, b) for a, b in pairwise(cuts) if b > a]
    for i in range(0, W_E.shape[0], chunk):
        X = W_E[i:i + chunk].double()
        X = rows(X) if rows is not None else X
        for a, b in blocks:
            G[a:b, a:].addmm_(X[:, a:b].T, X[:, a:])
    for a, b in blocks:
        G[b:, a:b] = G[a:b, b:].T
    return G


def factor_and_spectrum(W_E: torch.Tensor, rows=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A d_model x d_model R with ``W = Q R`` (Q orthonormal columns; ``W = rows(W_E)``, or W_E)
    and R's singular values, descending, in float64.

    Cholesky of the Gram matrix gives the same R (up to row signs) several times faster than
    Householder QR, but squares the condition number: used only while that is harmless (the
    Gram's eigenvalues, the squared singular values, say so), else the QR of W."""
    if W_E.shape[0] < W_E.shape[1]:
        raise ValueError(f"W_E is {tuple(W_E.shape)}: token space needs d_vocab >= d_model")
    G = embedding_gram(W_E, rows)
    s = torch.linalg.eigvalsh(G).clamp_min(0).sqrt().flip(0)
    if s[-1] > 0 and s[0] / s[-1] < GRAM_MAX_CONDITION:
        L, info = torch.linalg.cholesky_ex(G)
        del G
        if info == 0:
            return L.T.contiguous(), s
    del G
    W = W_E.double() if rows is None else rows(W_E.double())
    R = torch.linalg.qr(W, mode="r").R
    return R, torch.linalg.svdvals(R)


def embedding_factor(W_E: torch.Tensor) -> torch.Tensor:
    """A d_model x d_model R with ``W_E = Q R`` (Q orthonormal columns), in float64.

    The one O(d_vocab d_model^2) step of token space, done once per model at extraction.
    Under ``x -> x T``, ``W_E T = Q (R T)``: the factor of a transformed model is ``R T``."""
    return factor_and_spectrum(W_E)[0]


def embedding_basis(W_E: torch.Tensor | None = None, max_condition: float = DEFAULT_MAX_CONDITION,
                    factor: torch.Tensor | None = None) -> EmbeddingBasis:
    """R_E = S V^T and its inverse from W_E [d_vocab, d_model] (or from a factor R with
    W_E = Q R); never d_vocab x d_vocab."""
    if factor is not None:
        R0 = factor.double()
    elif W_E is not None:
        R0 = embedding_factor(W_E)
    else:
        raise ValueError("embedding_basis needs W_E or its factor")
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
    W_E = _vocabulary(w)
    if W_E.shape[0] < W_E.shape[1]:
        for space in TOKEN_SPACES:
            w.meta[f"{space}_condition"] = None
        return
    for space in TOKEN_SPACES:
        R, S = factor_and_spectrum(W_E, None if space == "token" else _row_normaliser(w))
        w.extras[f"R_{space}"] = R  # kept in float64: the basis change is sensitive to conditioning
        w.meta[f"{space}_condition"] = float(S[0] / S[-1]) if S[-1] > 0 else float("inf")


def space_factor(w: AttentionWeights, space: Space) -> torch.Tensor:
    """The factor R of the space's embedding (stored at extraction when available)."""
    if f"R_{space}" in w.extras:
        return w.extras[f"R_{space}"]
    return embedding_factor(_vocabulary(w) if space == "token" else normalised_embedding(w))


def space_basis(w: AttentionWeights, space: Space,
                max_condition: float = DEFAULT_MAX_CONDITION) -> tuple[EmbeddingBasis | None, dict]:
    """The basis of the given space (None for the residual stream) and facts about it (condition
    number...): what ``to_space`` applies, for a caller that changes the basis a few layers at a time."""
    if space == "residual":
        return None, {}
    if space not in WEIGHT_SPACES:
        raise ValueError(f"space {space!r} is not computed from the weights alone; choose from {WEIGHT_SPACES}")
    basis = embedding_basis(max_condition=max_condition, factor=space_factor(w, space))
    return basis, {"embedding_condition": basis.condition, "embedding_dropped": basis.n_dropped,
                   "max_condition": max_condition}


def to_space(w: AttentionWeights, space: Space, max_condition: float = DEFAULT_MAX_CONDITION) -> tuple[AttentionWeights, dict]:
    """The model's weights in the given space, plus facts about the basis (condition number...)."""
    basis, facts = space_basis(w, space, max_condition)
    return (w if basis is None else change_basis(w, basis.R, basis.R_inv)), facts
