"""Mathematical checks of the composition kernel (compatlas.composition.scores) against values derived
independently: by hand, from dense d_model x d_model matrices in float64, from transformer_lens,
or (for the null samplers) from exact moments and brute-force Monte Carlo.

Never is an expected value produced by the kernel itself, except in the GQA test, whose point
is that two layouts of the same model give the same kernel output.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import random_weights, tiny_hf_model

from compatlas.composition.nulls import gaussian_baseline, haar_overlap_blocks
from compatlas.composition.scores import head_factors, layer_pair_scores
from compatlas.models.weights import AttentionWeights
from compatlas.vocab import COMPS, KERNEL_METRICS

F64 = torch.float64
TOL = 1e-10


# ----------------------------------------------------------------------------- helpers


# every matrix here is tiny: one intra-op thread (conftest)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=F64)


def frame(g: torch.Generator, d: int, k: int) -> torch.Tensor:
    """A random d x k matrix with orthonormal columns."""
    return torch.linalg.qr(randn(g, d, k)).Q


def weights(W_Q, W_K, W_V, W_O) -> AttentionWeights:
    d = W_Q.shape[2]
    w = AttentionWeights(W_Q=W_Q, W_K=W_K, W_V=W_V, W_O=W_O, W_E=torch.eye(d, dtype=F64))
    w.validate()
    return w


def reader_layer(comp: str, A: torch.Tensor, Bt: torch.Tensor, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Per-head factors [d, dh] / [dh, d] of one reader head whose reader matrix for ``comp`` is
    ``R = A B`` (B = Bt^T): Q: R = W_Q W_K^T; K: R = W_K W_Q^T; V: R = W_V W_O.
    The factors the comp does not read are random."""
    d, dh = A.shape
    out = {"W_Q": randn(g, d, dh), "W_K": randn(g, d, dh), "W_V": randn(g, d, dh), "W_O": randn(g, dh, d)}
    if comp == "Q":
        out["W_Q"], out["W_K"] = A, Bt
    elif comp == "K":
        out["W_K"], out["W_Q"] = A, Bt
    else:
        out["W_V"], out["W_O"] = A, Bt.T
    return out


def pair_score(metric: str, comp: str, W_V1, W_O1, A2, Bt2, seed: int = 0) -> float:
    """Score of the one writer head of layer 0 (OV1 = W_V1 W_O1) into the one reader head of
    layer 1 (reader matrix A2 Bt2^T for ``comp``), through the kernel."""
    g = gen(seed)
    d, dh = W_V1.shape
    r = reader_layer(comp, A2, Bt2, g)
    layer0 = {"W_Q": randn(g, d, dh), "W_K": randn(g, d, dh), "W_V": W_V1, "W_O": W_O1}
    w = weights(*(torch.stack([layer0[k], r[k]])[:, None] for k in ("W_Q", "W_K", "W_V", "W_O")))
    s = layer_pair_scores(head_factors(w, metric), 0, [1], comp)
    assert s.shape == (1, 1, 1)
    return float(s[0, 0, 0])


def random_model(seed: int, L: int, H: int, Hkv: int, d: int, dh: int) -> AttentionWeights:
    """Gaussian factors with a random, non-flat spectrum per head and a random scale per head,
    so that normalisations and the sorted-spectrum denominator are actually exercised."""
    return random_weights(seed, L=L, H=H, Hkv=Hkv, d=d, dh=dh, spectrum=0.7, scale=1.0)


def kernel_all_pairs(w: AttentionWeights, metric: str, comp: str) -> torch.Tensor:
    """[L, H, L, H] kernel scores, zero where writer layer >= reader layer (the TL layout)."""
    L, H = w.n_layers, w.n_heads
    f = head_factors(w, metric)
    out = torch.zeros(L, H, L, H, dtype=w.W_Q.dtype)
    for l1 in range(L - 1):
        readers = list(range(l1 + 1, L))
        s = layer_pair_scores(f, l1, readers, comp)  # [nR, H1, H2]
        out[l1, :, l1 + 1:, :] = s.permute(1, 0, 2)
    return out


# ----------------------------------------------------------------------------- dense reference


def dense_LR(w: AttentionWeights, l1: int, h1: int, l2: int, h2: int, comp: str):
    """Full d_model x d_model L = OV1 and R of one pair; query head h uses kv head h // group."""
    grp = w.n_heads // w.n_kv_heads
    L = w.W_V[l1, h1 // grp] @ w.W_O[l1, h1]
    Q2, K2, V2, O2 = w.W_Q[l2, h2], w.W_K[l2, h2 // grp], w.W_V[l2, h2 // grp], w.W_O[l2, h2]
    R = {"Q": Q2 @ K2.T, "K": K2 @ Q2.T, "V": V2 @ O2}[comp]
    return L, R


def dense_score(metric: str, L: torch.Tensor, R: torch.Tensor, dh: int) -> float:
    if metric == "contribution":
        return float(torch.linalg.norm(L @ R))
    if metric == "frobenius":
        return float(torch.linalg.norm(L @ R) / (torch.linalg.norm(L) * torch.linalg.norm(R)))
    if metric == "svd_bound":
        sL = torch.linalg.svdvals(L)[:dh]
        sR = torch.linalg.svdvals(R)[:dh]
        return float(torch.linalg.norm(L @ R) / torch.sqrt((sL**2 * sR**2).sum()))
    # subspace: the writer writes into the row space of L (x -> x L), the reader reads from the
    # column space of R; orthonormal bases from the SVDs of the dense matrices (rank dh here).
    U1 = torch.linalg.svd(L.T).U[:, :dh]
    U2 = torch.linalg.svd(R).U[:, :dh]
    return float(torch.linalg.norm(U1.T @ U2) ** 2 / dh)


# ----------------------------------------------------------------------------- 1. identity


@pytest.mark.parametrize("d", [4, 8, 16])
@pytest.mark.parametrize("comp", COMPS)
def test_frobenius_identity_with_identity_is_inverse_sqrt_d(d, comp):
    # d_head == d_model is accepted (AttentionWeights.validate only rejects d_head > d_model),
    # so OV1 and R can both be the identity of R^d, built from non-trivial factors:
    # OV1 = (s O1)(O1^T / s) = I and R = (t O2)(O2^T / t) = I with O1, O2 random orthogonal.
    g = gen(100 + d)
    O1, O2 = frame(g, d, d), frame(g, d, d)
    s, t = 3.7, 0.21
    args = (s * O1, O1.T / s, t * O2, O2 / t)  # W_V1, W_O1, A2, Bt2 (B2 = Bt2^T = O2^T / t)
    # ||I I||_F / (||I||_F ||I||_F) = sqrt(d) / d
    assert pair_score("frobenius", comp, *args) == pytest.approx(1 / math.sqrt(d), abs=TOL)
    # all singular values are 1: sqrt(d) / sqrt(sum_i 1 * 1) = 1
    assert pair_score("svd_bound", comp, *args) == pytest.approx(1.0, abs=TOL)
    # both subspaces are all of R^d
    assert pair_score("subspace", comp, *args) == pytest.approx(1.0, abs=TOL)


# ----------------------------------------------------------------------------- 2. rank one


@pytest.mark.parametrize("comp", COMPS)
def test_frobenius_rank_one_constant_rows_times_constant_columns_is_one(comp):
    # L = c 1^T (row i constant, = c_i), R = 1 e^T (column j constant, = e_j).
    # L R = d c e^T, ||L R|| = d |c| |e|, ||L|| = sqrt(d) |c|, ||R|| = sqrt(d) |e|  =>  1.
    d, dh = 16, 4
    g = gen(7)
    ones = torch.ones(d, dtype=F64)
    W_V1 = randn(g, d, dh)  # full rank
    u = randn(g, dh)
    W_O1 = torch.outer(u, ones)  # rank 1: L = (W_V1 u) 1^T
    A2 = randn(g, d, dh)
    A2[:, 0] = ones  # full rank, first column 1
    e = randn(g, d)
    Bt2 = torch.zeros(d, dh, dtype=F64)
    Bt2[:, 0] = e  # B2 = delta_1 e^T, so R = A2 B2 = 1 e^T
    L, R = W_V1 @ W_O1, A2 @ Bt2.T
    assert torch.allclose(L, L[:, :1].expand(d, d))  # constant rows
    assert torch.allclose(R, R[:1, :].expand(d, d))  # constant columns
    assert pair_score("frobenius", comp, W_V1, W_O1, A2, Bt2) == pytest.approx(1.0, abs=TOL)
    # both rank 1, so svd_bound is also 1
    assert pair_score("svd_bound", comp, W_V1, W_O1, A2, Bt2) == pytest.approx(1.0, abs=TOL)
    # subspace: the writer's output subspace span(1) (rank 1) lies inside the reader's input
    # subspace span(A2) (rank dh, contains 1): one principal angle (min of the ranks), cosine 1
    assert pair_score("subspace", comp, W_V1, W_O1, A2, Bt2) == pytest.approx(1.0, abs=TOL)
    # ... and with the writer writing along a unit vector at angle phi to span(A2) instead
    Q = frame(g, d, dh + 1)
    A2p, n = Q[:, :dh] @ randn(g, dh, dh), Q[:, dh]
    phi = 0.4
    dir_ = math.cos(phi) * Q[:, 0] + math.sin(phi) * n
    W_O1p = torch.outer(u, dir_)
    assert pair_score("subspace", comp, W_V1, W_O1p, A2p, Bt2) == pytest.approx(math.cos(phi) ** 2, abs=TOL)


# ----------------------------------------------------------------------------- 3. svd_bound


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("comp", COMPS)
def test_svd_bound_between_frobenius_and_one_on_random_weights(seed, comp):
    w = random_model(seed, L=4, H=6, Hkv=3, d=24, dh=6)
    fro = kernel_all_pairs(w, "frobenius", comp)
    svb = kernel_all_pairs(w, "svd_bound", comp)
    mask = torch.zeros_like(fro, dtype=torch.bool)
    for l1 in range(w.n_layers):
        mask[l1, :, l1 + 1:, :] = True
    fro, svb = fro[mask], svb[mask]
    assert fro.numel() == 6 * 6 * 6  # 6 layer pairs x 36 head pairs
    assert (fro > 0).all()
    assert (svb >= fro - 1e-12).all()
    assert (svb <= 1 + 1e-12).all()
    assert (svb > fro + 1e-6).any()  # the bound is strictly tighter somewhere


def _aligned_factors(seed: int, d: int, k: int, a: torch.Tensor, b: torch.Tensor):
    """L = U diag(a) V^T (W_V1 = U diag(a), W_O1 = V^T), R = V diag(b) W^T (A = V diag(b), Bt = W)."""
    g = gen(seed)
    U, V, W = frame(g, d, k), frame(g, d, k), frame(g, d, k)
    return U * a, V.T, V * b, W


@pytest.mark.parametrize("comp", COMPS)
def test_svd_bound_is_one_when_singular_vectors_line_up_in_order(comp):
    d, k = 20, 5
    a = torch.tensor([9.0, 4.0, 2.5, 1.0, 0.3], dtype=F64)
    b = torch.tensor([5.0, 3.0, 2.0, 0.7, 0.1], dtype=F64)
    f = _aligned_factors(11, d, k, a, b)
    # L R = U diag(a b) W^T: ||L R||^2 = sum a_i^2 b_i^2, which is exactly the svd_bound denominator
    assert pair_score("svd_bound", comp, *f) == pytest.approx(1.0, abs=TOL)
    # and frobenius is sqrt(sum a^2 b^2) / (|a| |b|) < 1
    expect_fro = float(torch.sqrt((a**2 * b**2).sum()) / (a.norm() * b.norm()))
    assert expect_fro < 0.95
    assert pair_score("frobenius", comp, *f) == pytest.approx(expect_fro, abs=TOL)


@pytest.mark.parametrize("comp", COMPS)
def test_svd_bound_sorts_both_spectra_descending(comp):
    # Same construction, but R's largest singular value sits on L's smallest direction.
    # ||L R||^2 = sum a_i^2 b_i^2 (paired as built), denominator = sum of the sorted pairing.
    d, k = 20, 5
    a = torch.tensor([9.0, 4.0, 2.5, 1.0, 0.3], dtype=F64)
    b = torch.tensor([0.1, 0.7, 2.0, 3.0, 5.0], dtype=F64)
    f = _aligned_factors(12, d, k, a, b)
    num = (a**2 * b**2).sum()
    den = (a.sort(descending=True).values ** 2 * b.sort(descending=True).values ** 2).sum()
    expect = float(torch.sqrt(num / den))
    assert expect < 0.5
    assert pair_score("svd_bound", comp, *f) == pytest.approx(expect, abs=TOL)


# ----------------------------------------------------------------------------- 4. subspace


def _subspace_case(comp: str, thetas: torch.Tensor, seed: int) -> float:
    """Writer output subspace span(F) (W_O1 = M1 F^T); reader input subspace
    span(F cos(theta) + Fp sin(theta)) (A = that basis times M2), with Fp orthogonal to F:
    the principal angles are exactly theta."""
    d, dh = 24, thetas.numel()
    g = gen(seed)
    Q = frame(g, d, 2 * dh)
    F, Fp = Q[:, :dh], Q[:, dh:]
    M1, M2 = randn(g, dh, dh), randn(g, dh, dh)  # invertible a.s.; magnitudes must not matter
    W_O1 = M1 @ F.T
    A2 = (F * torch.cos(thetas) + Fp * torch.sin(thetas)) @ M2
    return pair_score("subspace", comp, randn(g, d, dh), W_O1, A2, randn(g, d, dh), seed=seed)


@pytest.mark.parametrize("comp", COMPS)
def test_subspace_coincident_orthogonal_and_partial(comp):
    dh = 6
    zero = torch.zeros(dh, dtype=F64)
    # reader input subspace = column space of W_Q2 (Q), W_K2 (K), W_V2 (V): A2 in reader_layer
    assert _subspace_case(comp, zero, 1) == pytest.approx(1.0, abs=TOL)
    assert _subspace_case(comp, zero + math.pi / 2, 2) == pytest.approx(0.0, abs=TOL)
    thetas = torch.tensor([0.0, 0.2, 0.5, 0.9, 1.2, math.pi / 2], dtype=F64)
    expect = float((torch.cos(thetas) ** 2).mean())  # mean squared cosine of principal angles
    got = _subspace_case(comp, thetas, 3)
    assert 0.0 < got < 1.0
    assert got == pytest.approx(expect, abs=TOL)
    # one small uniform rotation: strictly between, = cos^2(theta)
    got = _subspace_case(comp, zero + 0.3, 4)
    assert 0.0 < got < 1.0
    assert got == pytest.approx(math.cos(0.3) ** 2, abs=TOL)


# ----------------------------------------------------------------------------- 5. dense reference


@pytest.fixture(scope="module")
def gqa_model() -> AttentionWeights:
    return random_model(5, L=3, H=4, Hkv=2, d=32, dh=8)


@pytest.mark.parametrize("metric", KERNEL_METRICS)
@pytest.mark.parametrize("comp", COMPS)
def test_dense_reference_agreement_gqa(gqa_model, metric, comp):
    w = gqa_model
    L_, H, dh = w.n_layers, w.n_heads, w.d_head
    f = head_factors(w, metric)
    for l1 in range(L_):
        readers = list(range(L_))  # the kernel's algebra does not care about layer order
        got = layer_pair_scores(f, l1, readers, comp)
        assert got.shape == (L_, H, H) and got.dtype == F64
        expect = torch.empty_like(got)
        for i, l2 in enumerate(readers):
            for h1 in range(H):
                for h2 in range(H):
                    L, R = dense_LR(w, l1, h1, l2, h2, comp)
                    expect[i, h1, h2] = dense_score(metric, L, R, dh)
        torch.testing.assert_close(got, expect, atol=TOL, rtol=0)


# ----------------------------------------------------------------------------- 6. GQA


@pytest.mark.parametrize("metric", KERNEL_METRICS)
@pytest.mark.parametrize("comp", COMPS)
def test_gqa_equals_repeat_interleaved_kv(gqa_model, metric, comp):
    w = gqa_model
    grp = w.n_heads // w.n_kv_heads
    assert grp == 2
    full = weights(w.W_Q, w.W_K.repeat_interleave(grp, 1), w.W_V.repeat_interleave(grp, 1), w.W_O)
    assert full.n_kv_heads == full.n_heads
    fg, ff = head_factors(w, metric), head_factors(full, metric)
    for l1 in range(w.n_layers - 1):
        readers = list(range(l1 + 1, w.n_layers))
        a = layer_pair_scores(fg, l1, readers, comp)
        b = layer_pair_scores(ff, l1, readers, comp)
        # the grouped path multiplies in another order (emit A, then R_B^T): equal to rounding
        # (of the scores' scale: 1, or a contribution's size)
        torch.testing.assert_close(a, b, atol=1e-12 * max(1.0, float(b.abs().max())), rtol=0)


# ----------------------------------------------------------------------------- 7. transformer_lens


def _boot_bridge(kind: str, root):
    import transformers
    from tokenizers import Tokenizer, models
    from transformer_lens.model_bridge import TransformerBridge

    transformers.logging.set_verbosity_error()
    torch.manual_seed(1234)
    model = tiny_hf_model("gpt2" if kind == "gpt2" else "llama-gqa", 64)
    d = root / kind
    model.save_pretrained(d)
    tk = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(64)}, unk_token="t0"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", bos_token="t0",
                                         eos_token="t0").save_pretrained(d)
    tok = transformers.AutoTokenizer.from_pretrained(d)  # carries name_or_path, as the bridge needs
    return TransformerBridge.boot_transformers(str(d), tokenizer=tok, dtype=F64)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def bridge(request, tmp_path_factory):
    return request.param, _boot_bridge(request.param, tmp_path_factory.mktemp("tl"))


@pytest.mark.parametrize("comp", COMPS)
def test_frobenius_matches_transformer_lens(bridge, comp):
    kind, b = bridge
    w = AttentionWeights(W_Q=b.W_Q.detach(), W_K=b.W_K.detach(), W_V=b.W_V.detach(),
                         W_O=b.W_O.detach(), W_E=b.W_E.detach())
    w.validate()
    assert w.W_Q.dtype == F64
    assert (w.n_layers, w.n_heads, w.d_model, w.d_head) == (3, 4, 32, 8)
    assert w.n_kv_heads == (2 if kind == "llama" else 4)
    with torch.no_grad():
        ref = b.all_composition_scores(comp).scores.detach()
    assert ref.shape == (3, 4, 3, 4)
    assert ref.dtype == F64
    got = kernel_all_pairs(w, "frobenius", comp)
    assert ref.abs().max() > 0.05  # not a trivially zero comparison
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)


# ----------------------------------------------------------------------------- 8. nulls


def _haar_frames(rng: np.random.Generator, n: int, d: int, k: int) -> np.ndarray:
    """n Haar-distributed d x k orthonormal frames, brute force: QR of a Gaussian, signs fixed."""
    Q, R = np.linalg.qr(rng.standard_normal((n, d, k)))
    return Q * np.sign(np.diagonal(R, axis1=1, axis2=2))[:, None, :]


def _overlap_moments_exact(d: int, k: int) -> tuple[float, float]:
    """E X and E X^2 for X = ||E^T U||_F^2 = sum_{i,j<k} U_ij^2, U Haar on O(d), from the
    Weingarten moments E U11^4 = 3/(d(d+2)), E U11^2 U12^2 = 1/(d(d+2)),
    E U11^2 U22^2 = (d+1)/(d(d-1)(d+2)). (Check: k = d gives E X^2 = d^2.)"""
    m1 = k * k / d
    m2 = (3 * k**2 + 2 * k**2 * (k - 1)) / (d * (d + 2)) + k**2 * (k - 1) ** 2 * (d + 1) / (d * (d - 1) * (d + 2))
    return m1, m2


@pytest.mark.parametrize("d,k", [(12, 4), (8, 4), (7, 4), (5, 4)])  # d - k >= k: Bartlett; < k: G_rest
def test_haar_overlap_blocks_match_brute_force(d, k):
    from scipy import stats

    n = 12000
    P = haar_overlap_blocks(d, k, n, seed=2024 + d).numpy()
    assert P.shape == (n, k, k)
    rng = np.random.default_rng(99 + d)
    V, U = _haar_frames(rng, n, d, k), _haar_frames(rng, n, d, k)
    P_bf = V.transpose(0, 2, 1) @ U

    m1, m2 = _overlap_moments_exact(d, k)
    # sanity of the exact moments with k = d: X = d always
    assert _overlap_moments_exact(d, d)[1] == pytest.approx(d * d, rel=1e-12)
    sd = math.sqrt(m2 - m1 * m1)
    sd2 = None
    for sample in (P, P_bf):
        X = (sample**2).sum(axis=(1, 2))
        assert (X >= -1e-12).all() and (X <= k + 1e-9).all()  # sum of k squared cosines
        # sample mean and second moment within 5 standard errors of the exact values
        assert abs(X.mean() - m1) < 5 * sd / math.sqrt(n)
        sd2 = (X**2).std()
        assert abs((X**2).mean() - m2) < 5 * sd2 / math.sqrt(n)
    X, X_bf = (P**2).sum(axis=(1, 2)), (P_bf**2).sum(axis=(1, 2))
    # the two samples side by side: means and second moments within 5 combined standard errors
    assert abs(X.mean() - X_bf.mean()) < 5 * sd * math.sqrt(2 / n)
    assert abs((X**2).mean() - (X_bf**2).mean()) < 5 * sd2 * math.sqrt(2 / n)
    # whole distributions: of X, of one entry (E P11^2 = 1/d, E P11^4 = 3/(d(d+2))), of the top
    # singular value. Seeds are fixed, so these are deterministic; alpha = 1e-3.
    assert stats.ks_2samp(X, X_bf).pvalue > 1e-3
    assert stats.ks_2samp(P[:, 0, 0], P_bf[:, 0, 0]).pvalue > 1e-3
    assert stats.ks_2samp(P[:, k - 1, 0], P_bf[:, k - 1, 0]).pvalue > 1e-3
    # cosines of the principal angles; when 2k > d the top 2k - d of them are exactly 1 (the two
    # subspaces must intersect), so compare the smallest one, and the largest only when 2k <= d
    s, s_bf = np.linalg.svd(P, compute_uv=False), np.linalg.svd(P_bf, compute_uv=False)
    assert (s <= 1 + 1e-9).all()
    if 2 * k > d:
        np.testing.assert_allclose(s[:, : 2 * k - d], 1.0, atol=1e-9)
    assert stats.ks_2samp(s[:, -1], s_bf[:, -1]).pvalue > 1e-3
    if 2 * k <= d:
        assert stats.ks_2samp(s[:, 0], s_bf[:, 0]).pvalue > 1e-3
    e4 = 3 / (d * (d + 2))
    assert abs((P[:, 0, 0] ** 4).mean() - e4) < 5 * math.sqrt(105 / (d * (d + 2) * (d + 4) * (d + 6))) / math.sqrt(n)


def test_haar_overlap_blocks_square_is_orthogonal():
    # d == k: the frame is all of R^d, so V^T U is orthogonal
    P = haar_overlap_blocks(5, 5, 50, seed=3).numpy()
    eye = np.broadcast_to(np.eye(5), P.shape)
    np.testing.assert_allclose(P.transpose(0, 2, 1) @ P, eye, atol=1e-10)


def _dense_gaussian_scores(metric: str, comp: str, d: int, dh: int, n: int, seed: int) -> np.ndarray:
    """Brute force: n independent (writer, reader) pairs with Gaussian factors, dense d x d L and R."""
    rng = np.random.default_rng(seed)
    G = lambda *s: rng.standard_normal((n, *s))  # noqa: E731
    W_V1, W_O1 = G(d, dh), G(dh, d)
    W_Q2, W_K2, W_V2, W_O2 = G(d, dh), G(d, dh), G(d, dh), G(dh, d)
    L = W_V1 @ W_O1
    R = {"Q": W_Q2 @ W_K2.transpose(0, 2, 1), "K": W_K2 @ W_Q2.transpose(0, 2, 1), "V": W_V2 @ W_O2}[comp]
    nrm = lambda M: np.sqrt((M**2).sum(axis=(1, 2)))  # noqa: E731
    if metric == "frobenius":
        return nrm(L @ R) / (nrm(L) * nrm(R))
    if metric == "svd_bound":
        sL = np.linalg.svd(L, compute_uv=False)[:, :dh]
        sR = np.linalg.svd(R, compute_uv=False)[:, :dh]
        return nrm(L @ R) / np.sqrt((sL**2 * sR**2).sum(-1))
    A2 = {"Q": W_Q2, "K": W_K2, "V": W_V2}[comp]
    U1 = np.linalg.qr(W_O1.transpose(0, 2, 1))[0]
    U2 = np.linalg.qr(A2)[0]
    return nrm(U1.transpose(0, 2, 1) @ U2) ** 2 / dh


@pytest.mark.parametrize(
    "metric,comp",
    [("frobenius", c) for c in COMPS] + [("subspace", c) for c in COMPS] + [("svd_bound", "Q")],
)
def test_gaussian_baseline_matches_brute_force(metric, comp):
    # d_model / d_head = 8, as for 768 / 64 (12); small enough for a dense brute force
    d, dh, n_heads = 32, 4, 40
    mean, std = gaussian_baseline(metric, comp, d, dh, n=n_heads, seed=17)
    bf = _dense_gaussian_scores(metric, comp, d, dh, n=2000, seed=18)
    # The kernel's n x n pairs share writers and readers: the variance of their mean is at most
    # sigma^2 (2/n + 1/n^2). The brute-force pairs are independent.
    se = math.sqrt(bf.var() * (2 / n_heads + 1 / n_heads**2) + bf.var() / bf.size)
    assert abs(mean - bf.mean()) < 5 * se
    assert std == pytest.approx(bf.std(), rel=0.25)
    if metric == "frobenius":
        # exact: the law of R is invariant under R -> O R (O orthogonal, the Gaussian factor A of
        # R = A B absorbs it), and E_O ||L O R||^2 = tr(L E[O R R^T O^T] L^T) = ||L||^2 ||R||^2 / d,
        # so E[score^2] = 1/d; the mean is 1/sqrt(d) up to a small Jensen gap (1.5% at 32/4)
        N = n_heads**2
        sq = mean**2 + std**2 * (N - 1) / N
        sq_bf = (bf**2).mean()
        se_sq = (bf**2).std() * math.sqrt(2 / n_heads + 1 / n_heads**2)
        assert abs(sq - 1 / d) < 5 * se_sq
        assert abs(sq_bf - 1 / d) < 5 * (bf**2).std() / math.sqrt(bf.size)
        assert mean == pytest.approx(1 / math.sqrt(d), rel=0.05)
    if metric == "subspace":
        # exact: E ||U1^T U2||^2 = dh^2 / d for independent uniform subspaces, so E score = dh / d
        assert abs(mean - dh / d) < 5 * se
        assert abs(bf.mean() - dh / d) < 5 * bf.std() / math.sqrt(bf.size)
