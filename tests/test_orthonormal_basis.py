"""The subspace family's orthonormal bases (``composition.scores._orthonormal_bases``: CholeskyQR2,
the GPU's, with Householder QR for the heads it flags; Householder QR, the CPU's) against
independent computations: the float64 SVD of each head's matrix (its rank and the projector onto
its column space), the Householder path itself for flagged heads, dense d_model x d_model
references and the subspace scores of the same weights in float64. CholeskyQR2 is asked for by
name (or through ``scores.BASIS``), so that the CPU checks the GPU's algorithm.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import random_weights
from test_composition import dense_LR, dense_score, random_model

from compatlas.composition import scores
from compatlas.composition.scores import (
    _cholesky_qr2,
    _householder_basis,
    _orthonormal_basis,
    head_factors,
    layer_pair_scores,
)
from compatlas.models.weights import AttentionWeights
from compatlas.vocab import COMPS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N, K = 256, 32
PROJ_TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
ORTH_TOL = {torch.float32: 1e-5, torch.float64: 1e-13}


def heads(dtype: torch.dtype) -> tuple[torch.Tensor, list[str]]:
    """[8, N, K] head matrices, each named: well conditioned ones (CholeskyQR2's), a graded spectrum
    inside its threshold, and heads it must hand over (zero, rank deficient, past the threshold)."""
    g = torch.Generator().manual_seed(47)

    def with_spectrum(s: torch.Tensor) -> torch.Tensor:
        U = torch.linalg.qr(torch.randn(N, K, generator=g, dtype=torch.float64)).Q
        V = torch.linalg.qr(torch.randn(K, K, generator=g, dtype=torch.float64)).Q
        return (U * s) @ V.T

    gauss = torch.randn(3, N, K, generator=g, dtype=torch.float64) / N**0.5
    dup = gauss[0].clone()
    dup[:, K // 2:] = dup[:, :K // 2]  # duplicated columns (a GQA-like repeat): rank K / 2
    low = torch.randn(N, 20, generator=g, dtype=torch.float64) @ torch.randn(20, K, generator=g, dtype=torch.float64)
    past = 1e4 if dtype == torch.float32 else 1e9  # full rank by the rank test, past eps^-1/2
    A = torch.stack([gauss[0], gauss[1], gauss[2],
                     with_spectrum(torch.logspace(0, -2, K, dtype=torch.float64)),  # kappa 100
                     torch.zeros(N, K, dtype=torch.float64), dup, low,
                     with_spectrum(torch.logspace(0, -np.log10(past), K, dtype=torch.float64))])
    return A.to(dtype), ["gauss", "gauss", "gauss", "kappa100", "zero", "duplicated", "rank20", "past"]


def reference(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank, projector onto the column space) of each head from the float64 SVD of its stored
    values, with the kernel's rank rule (singular values above s_max max(n, k) eps of A's dtype)."""
    U, S, _ = torch.linalg.svd(A.double(), full_matrices=False)
    tol = S[:, :1] * max(N, K) * torch.finfo(A.dtype).eps
    keep = (S > tol).double()
    Uk = U * keep[:, None, :]
    return keep.sum(-1), Uk @ Uk.transpose(-2, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cholesky_qr2_takes_the_well_conditioned_heads_and_flags_the_others(dtype):
    A, names = heads(dtype)
    Q, R, ok = _cholesky_qr2(A)
    expect_ok = [n in ("gauss", "kappa100") for n in names]
    assert ok.tolist() == expect_ok
    # where it is trusted: orthonormal to rounding, and A = Q R
    I = torch.eye(K, dtype=dtype)
    for i in np.flatnonzero(expect_ok):
        assert float((Q[i].T @ Q[i] - I).abs().max()) < ORTH_TOL[dtype]
        assert float((Q[i] @ R[i] - A[i]).norm() / A[i].norm()) < 50 * torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_basis_spans_the_column_space_with_the_svd_rank(dtype):
    A, names = heads(dtype)
    U, keep = _orthonormal_basis(A, "cholesky_qr2")
    rank, P_ref = reference(A)
    assert keep.sum(-1).tolist() == rank.tolist()
    assert rank.tolist() == [K, K, K, K, 0, K // 2, 20, K]  # the cases are what their names say
    P = (U @ U.transpose(-2, -1)).double()
    for i, name in enumerate(names):
        # span error ~ eps kappa(A) for any QR: at kappa 1e4 (1e9) only to 1e-2 (1e-6) of the SVD's
        tol = PROJ_TOL[dtype] * (1e3 if name == "past" else 10 if name == "kappa100" else 1)
        assert float((P[i] - P_ref[i]).abs().max()) < tol, name
        # orthonormal on the kept columns, zero beyond
        G = (U[i].T @ U[i]).double()
        assert float((G - torch.diag(keep[i].double())).abs().max()) < ORTH_TOL[dtype], name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_flagged_heads_get_the_householder_basis_itself(dtype):
    A, names = heads(dtype)
    U, keep = _orthonormal_basis(A, "cholesky_qr2")
    flagged = [i for i, n in enumerate(names) if n not in ("gauss", "kappa100")]
    U_h, keep_h = _householder_basis(A[flagged])
    torch.testing.assert_close(U[flagged], U_h, rtol=0, atol=0)
    torch.testing.assert_close(keep[flagged], keep_h, rtol=0, atol=0)


def test_one_flagged_head_leaves_the_others_on_cholesky_qr2():
    """A zero head among full-rank ones sends that head alone to Householder: the others keep
    CholeskyQR2's Q (the old path rotated every head of a batch by its R's singular vectors)."""
    A, _ = heads(torch.float64)
    batch = A[[0, 1, 4]]  # gauss, gauss, zero
    U, keep = _orthonormal_basis(batch, "cholesky_qr2")
    Q, _, ok = _cholesky_qr2(batch)
    assert ok.tolist() == [True, True, False]
    torch.testing.assert_close(U[:2], Q[:2], rtol=0, atol=0)
    assert keep[:2].eq(1).all() and keep[2].eq(0).all() and U[2].eq(0).all()


def _with_degenerate_heads(w: AttentionWeights) -> AttentionWeights:
    """w with a zero W_O head, a rank-deficient W_Q head and two identical KV heads."""
    W_Q, W_K, W_V, W_O = (x.clone() for x in (w.W_Q, w.W_K, w.W_V, w.W_O))
    W_O[0, 1] = 0
    W_Q[1, 2, :, 3:] = W_Q[1, 2, :, :3].repeat(1, 2)[:, :W_Q.shape[-1] - 3]
    W_K[2, 1], W_V[2, 1] = W_K[2, 0], W_V[2, 0]
    return AttentionWeights(W_Q=W_Q, W_K=W_K, W_V=W_V, W_O=W_O, W_E=w.W_E)


@pytest.fixture
def cholesky_qr2_on_cpu(monkeypatch):
    monkeypatch.setitem(scores.BASIS, "cpu", "cholesky_qr2")


def test_the_cpu_default_is_householder_and_the_gpu_default_cholesky_qr2():
    A, _ = heads(torch.float64)
    for got, expect in zip(_orthonormal_basis(A), _householder_basis(A), strict=True):
        torch.testing.assert_close(got, expect, rtol=0, atol=0)
    assert scores.BASIS["cuda"] == "cholesky_qr2"


@pytest.mark.usefixtures("cholesky_qr2_on_cpu")
@pytest.mark.parametrize("comp", COMPS)
def test_subspace_by_cholesky_qr2_matches_the_dense_reference(comp):
    """As test_composition's dense-reference test, with the GPU's bases."""
    w = random_model(5, L=3, H=4, Hkv=2, d=32, dh=8)
    f = head_factors(w, "subspace")
    for l1 in range(3):
        got = layer_pair_scores(f, l1, [0, 1, 2], comp)
        expect = torch.tensor([[[dense_score("subspace", *dense_LR(w, l1, h1, l2, h2, comp), w.d_head)
                                 for h2 in range(w.n_heads)] for h1 in range(w.n_heads)] for l2 in range(3)],
                              dtype=torch.float64)
        torch.testing.assert_close(got, expect, atol=1e-10, rtol=0)


@pytest.mark.usefixtures("cholesky_qr2_on_cpu")
@pytest.mark.parametrize("comp", COMPS)
def test_subspace_scores_in_float32_match_float64(comp):
    """The kernel's float32 subspace scores (CholeskyQR2 on most heads) against its float64 ones,
    degenerate heads included, and against the Householder bases' float32 scores."""
    w64 = _with_degenerate_heads(random_weights(3, L=3, H=4, Hkv=2, d=64, dh=8, spectrum=0.7, scale=1.0))
    w32 = AttentionWeights(W_Q=w64.W_Q.float(), W_K=w64.W_K.float(), W_V=w64.W_V.float(), W_O=w64.W_O.float(),
                           W_E=w64.W_E.float())
    f64, f32 = head_factors(w64, "subspace"), head_factors(w32, "subspace")
    torch.testing.assert_close(f32.writer_sv.double(), f64.writer_sv, rtol=0, atol=0)  # the same ranks
    torch.testing.assert_close(f32.reader_sv[comp].double(), f64.reader_sv[comp], rtol=0, atol=0)
    assert f64.writer_sv[0, 1].eq(0).all()  # the zero head has rank 0
    scores.BASIS["cpu"] = "householder"  # monkeypatch restores it
    f32_h = head_factors(w32, "subspace")
    for l1 in range(3):
        s64 = layer_pair_scores(f64, l1, [0, 1, 2], comp)
        s32 = layer_pair_scores(f32, l1, [0, 1, 2], comp)
        torch.testing.assert_close(s32.double(), s64, rtol=0, atol=2e-5)
        torch.testing.assert_close(s32, layer_pair_scores(f32_h, l1, [0, 1, 2], comp), rtol=0, atol=2e-6)
