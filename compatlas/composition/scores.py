"""Q-, K- and V-composition scores for every writer/reader head pair, kept factored.

Conventions (row vectors; docs/math.md#conventions): the writer head h1 has
``OV1 = W_V1 W_O1``; the reader matrix ``R = A B`` is ``QK2 = W_Q2 W_K2^T`` (Q),
``QK2^T = W_K2 W_Q2^T`` (K) or ``OV2 = W_V2 W_O2`` (V). Composition looks at ``L R`` with
``L = OV1``.

Never a d_model x d_model product per pair: with thin QRs ``W_V1 = Q R_V1`` and
``B^T = Q R_B``, ``||W_V1 (W_O1 A) B||_F = ||R_V1 W_O1 A R_B^T||_F``. So each writer head
gets an ``emit`` matrix ``R_V1 W_O1`` [d_head, d_model], each reader head an ``absorb``
matrix ``A R_B^T`` [d_model, d_head], and the d_head x d_head cores of all head pairs of a
layer pair come out of one matrix product. Singular values of ``OV`` and ``QK`` are those
of their d_head x d_head cores ``R_A R_B^T``.

Grouped-query attention: the K and V readers' ``A`` (``W_K``, ``W_V``) is shared by the g query
heads of a KV group, so ``absorb = A R_B^T`` splits into the shared ``A`` [d_model, d_head] and a
per-query-head ``post = R_B^T`` [d_head, d_head]: the d_model-long product ``emit A`` is computed
once per KV head and each query head adds only a d_head x d_head one. For ``subspace`` the
reader's basis is that of ``A`` itself, shared by the whole group. K and V cost about 1/g + d_head/d_model
of the full product (SmolLM2, g = 3: 0.45; Llama-2-70B, g = 8: 0.14).

Metrics (the first three in [0, 1]):

- ``frobenius``: ``||L R||_F / (||L||_F ||R||_F)`` (Mathematical Framework).
- ``svd_bound``: ``||L R||_F / sqrt(sum_i s_i(L)^2 s_i(R)^2)``, both spectra sorted
  descending (Lieberum's tighter denominator; von Neumann's trace inequality makes it <= 1).
- ``subspace``: mean squared cosine of the principal angles between the writer's output
  subspace (row space of W_O1) and the reader's input subspace (column space of A), over
  ``min(rank1, rank2)`` angles. Deliberately magnitude-free: it asks *where* a head writes
  and reads, so Lieberum's axioms 1 and 2 hold exactly; the two metrics above carry the
  magnitudes.
- ``contribution``: ``||L R||_F`` itself, a magnitude: in residual space the weights' own
  (every input isotropic), in the ``activation`` space the RMS of what the writer adds to the
  reader's logit or output on the model's own statistics (``compatlas.composition.activation_space``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from compatlas.composition.small_linalg import on_host
from compatlas.models.weights import AttentionWeights
from compatlas.runtime import one_thread, one_thread_on
from compatlas.tiles import (  # noqa: F401 -- re-exported (the section "layer pairs" below)
    block_layers,
    block_pairs,
    layer_pairs,
    null_pairs,
    touched_layers,
)
from compatlas.vocab import COMPS, KERNEL_METRICS, Comp, Metric


@dataclass
class HeadFactors:
    """Per-head factors of one model for one metric: everything pair scores need.

    ``emit``: [L, H, d_head, d_model]; ``absorb[c]``: [L, H / g, d_model, d_head], one per
    query head (g = 1), or per KV head where a KV group of g query heads shares it; ``post[c]``: None or
    [L, H, d_head, d_head], the per-query-head right factor of a shared ``absorb``;
    ``*_norm``: [L, H] Frobenius norms; ``*_sv``: [L, H, d_head] singular values,
    descending (for ``subspace``: 1 on the head's rank, 0 beyond). ``absorb_cols[c]``: the same
    ``absorb`` laid out [d_model, L * H / g * d_head], so that a writer's reader layers are one
    column slice of it (no copy per layer pair).
    """

    metric: Metric
    emit: torch.Tensor | None  # None once a job has no GEMM to run on it (job_factors._strip)
    writer_norm: torch.Tensor
    writer_sv: torch.Tensor
    absorb: dict[str, torch.Tensor]
    reader_norm: dict[str, torch.Tensor]
    reader_sv: dict[str, torch.Tensor]
    post: dict[str, torch.Tensor | None] = field(default_factory=dict)
    absorb_cols: dict[str, torch.Tensor] = field(default_factory=dict)

    def gemm_emit(self) -> torch.Tensor:
        """``emit``, which only a family whose GEMM runs keeps (a sandwiched one's cores come from the base's)."""
        if self.emit is None:
            raise ValueError(f"these {self.metric} factors were stripped of emit: they run no GEMM of their own")
        return self.emit


def _r_factor(A: torch.Tensor) -> torch.Tensor:
    """An upper-triangular R [..., k, k] with ``R^T R = A^T A`` for A [..., n, k] (n >= k), so
    ``||A X||_F = ||R X||_F`` for every X.

    Cholesky of the Gram matrix: one batched GEMM and a k x k factorisation, a third of a QR's
    cost on tall A. It is backward stable (``R^T R = A^T A + E``, ``||E|| ~ eps ||A||^2``), which
    is all a norm needs; heads whose Gram matrix is not numerically positive definite (rank
    deficient) fall back to the QR's R."""
    G = A.transpose(-2, -1) @ A  # the d_model-long product: all threads
    with one_thread():
        R, info = torch.linalg.cholesky_ex(G, upper=True)
        bad = info != 0
        if bool(bad.any()):
            R[bad] = torch.linalg.qr(A[bad], mode="r").R
    return R


CHOLQR2_MAX_LOSS = 0.5  # ||Q1^T Q1 - I||_F past which a head leaves CholeskyQR2 for Householder QR
# the subspace bases' algorithm per device type (``_orthonormal_bases``). A GPU: CholeskyQR2, 0.013 s
# a 70B layer's heads on an H200 against torch.linalg.qr's 0.169 s (issue 47). The CPU: Householder
# QR, whose LAPACK runs at GEMM speed there on half CholeskyQR2's FLOPs (4 n k^2 against 8): on 2
# cores, 256 heads of 2048 x 128, 0.89 s on one thread against 0.59 s (two threads) to 1.04 s (one)
BASIS: dict[str, str] = {"cuda": "cholesky_qr2", "cpu": "householder"}


def _cholesky_qr2(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CholeskyQR2 of A [..., n, k] (n >= k), batched and on A's device: (Q [..., n, k], R [..., k, k],
    ok [...]), ``A = Q R``, with ``ok`` False for the heads it cannot be trusted on.

    One pass: ``G = A^T A = R1^T R1`` (Cholesky), ``Q1 = A R1^-1``; a second on Q1: ``Q1^T Q1 =
    R2^T R2``, ``Q = Q1 R2^-1``, ``R = R2 R1``. Four d_model-long GEMMs and k x k work: on an H200
    0.013 s for a 70B layer's 144 heads against 0.169 s for ``torch.linalg.qr`` (issue 47). The
    triangular inverses are applied as GEMMs with ``R^-1`` (a k x k triangular solve against I):
    whatever nonsingular X is used, ``span(A X) = span(A)`` up to the GEMM's rounding, and how far
    ``A X`` is from orthonormal is measured below, not assumed.

    Accuracy (Yamamoto et al. 2015, ETNA 44): forming G squares the condition number, so the first
    pass loses orthogonality as ``||Q1^T Q1 - I|| ~ eps kappa(A)^2``. While that is below 1, Q1 is
    well conditioned (``kappa(Q1)^2 <= (1 + loss) / (1 - loss)``), and the second pass, a CholeskyQR
    of a well-conditioned matrix, ends at ``||Q^T Q - I|| = O(eps)`` and ``||A - Q R|| =
    O(eps ||A||)``: as good as Householder QR, so R's singular values are A's to ``eps ||A||``
    and the span's error is the ``eps kappa(A)`` any QR has. The condition for this is
    ``kappa(A) <~ eps^-1/2``: about 3e3 in float32, 7e7 in float64.

    The threshold is tested a posteriori, per head, on the first pass's measured loss of
    orthogonality, ``||Q1^T Q1 - I||_F = ||G2 - I||_F`` (G2 is formed anyway): ``ok`` needs both
    Cholesky factorisations to succeed and that loss <= ``CHOLQR2_MAX_LOSS`` (0.5: kappa(Q1) <= 1.8;
    about ``kappa(A) < (0.5 / eps)^1/2``, 2e3 in float32). A ratio of R1's diagonal entries would
    only bound kappa(A) from below. Beyond the threshold (zero or rank-deficient heads, whose G is
    singular, or kappa past eps^-1/2) the caller takes Householder QR for those heads alone."""
    k = A.shape[-1]
    eye = torch.eye(k, dtype=A.dtype, device=A.device)
    G = A.transpose(-2, -1) @ A  # the d_model-long products: all threads
    with one_thread_on(A.device):  # k x k work: a thread hand-off costs more
        R1, info1 = torch.linalg.cholesky_ex(G, upper=True)
        X1 = torch.linalg.solve_triangular(R1, eye, upper=True)
    Q1 = A @ X1
    G2 = Q1.transpose(-2, -1) @ Q1
    with one_thread_on(A.device):
        R2, info2 = torch.linalg.cholesky_ex(G2, upper=True)
        X2 = torch.linalg.solve_triangular(R2, eye, upper=True)
        loss = torch.linalg.matrix_norm(G2 - eye)  # NaN where R1 failed: not <=, so not ok
        ok = (info1 == 0) & (info2 == 0) & (loss <= CHOLQR2_MAX_LOSS)
        R = R2 @ R1
    return Q1 @ X2, R, ok


def _householder_basis(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_orthonormal_bases``' fallback for heads CholeskyQR2 cannot take (rank deficient, or past its
    condition threshold): Householder QR, then the SVD of the small R where a head is rank deficient."""
    Q, R = torch.linalg.qr(A)  # then the singular values of the small k x k R, not of A
    S = on_host(torch.linalg.svdvals, R)
    tol = S[..., :1] * max(A.shape[-2:]) * torch.finfo(A.dtype).eps
    if bool((S > tol).all()):  # every head full rank: Q is a basis already (no score sees its rotation)
        return Q, torch.ones_like(S)
    U_R, S, _ = on_host(torch.linalg.svd, R)  # rank-deficient heads: R's singular vectors order Q's columns
    keep = (S > tol).to(A.dtype)
    return (Q @ U_R) * keep[..., None, :], keep


def _orthonormal_bases(mats: list[torch.Tensor], method: str | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Orthonormal bases of the column spaces of each A [..., n, k] of ``mats`` (same k), zero-padded
    past their ranks: (U [..., n, k], indicator [..., k] of the kept columns) per A.

    ``method`` (default: ``BASIS`` of the device's type): ``"householder"``, ``_householder_basis``
    of each A; or ``"cholesky_qr2"``, CholeskyQR2 for every head (``_cholesky_qr2``), on the device,
    with the rank test (singular values above ``s_max max(n, k) eps``) on the singular values of
    its small R, all of ``mats``' heads in one batch (``small_linalg.on_host``: one trip to the host
    on a GPU, not one per weight); a head CholeskyQR2 flags, or that is rank deficient, gets
    ``_householder_basis``, alone. A full-rank head's basis is Q itself: no score sees its rotation."""
    method = method or BASIS.get(mats[0].device.type, "cholesky_qr2")
    if method == "householder":
        with one_thread():  # small batched factorisations: a thread hand-off per call costs more (runtime.one_thread)
            return [_householder_basis(A) for A in mats]
    if method != "cholesky_qr2":
        raise ValueError(f"no basis method {method!r}: householder or cholesky_qr2")
    parts = [_cholesky_qr2(A) for A in mats]
    k = mats[0].shape[-1]
    # a flagged head's R may hold NaN (a failed Cholesky), which the SVD refuses: zeros, and the head is redone
    R_all = torch.cat([torch.where(ok[..., None, None], R, 0).reshape(-1, k, k) for _, R, ok in parts])
    with one_thread_on(R_all.device):
        S_all = on_host(torch.linalg.svdvals, R_all).split([A[..., 0, 0].numel() for A in mats])
    out = []
    for A, (Q, _, ok), S in zip(mats, parts, S_all):
        S = S.view(*A.shape[:-2], k)
        tol = S[..., :1] * max(A.shape[-2:]) * torch.finfo(A.dtype).eps
        good = ok & (S > tol).all(-1)
        keep = torch.ones_like(S)
        if not bool(good.all()):
            bad = ~good
            with one_thread_on(A.device):
                Q[bad], keep[bad] = _householder_basis(A[bad])
        out.append((Q, keep))
    return out


def _orthonormal_basis(A: torch.Tensor, method: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Orthonormal basis of the column space of A [..., n, k], zero-padded past its rank:
    (U [..., n, k], indicator [..., k] of the kept columns); ``_orthonormal_bases`` of one."""
    return _orthonormal_bases([A], method)[0]


def _core_spectra(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Norm and singular values of each ``A B`` from the R factors (R_A, R_B) of A and B^T, every
    core's singular values in one batch (one trip to the host on a GPU: ``small_linalg.on_host``)."""
    cores = [R_A @ R_B.transpose(-2, -1) for R_A, R_B in pairs]
    k = cores[0].shape[-1]
    svs = on_host(torch.linalg.svdvals, torch.cat([c.reshape(-1, k, k) for c in cores]))
    svs = svs.split([c[..., 0, 0].numel() for c in cores])
    return [(sv.pow(2).sum(-1).sqrt(), sv) for sv in (s.view(*c.shape[:-1]) for s, c in zip(svs, cores))]


# the weights (A, B^T) of each reader matrix R = A B, as in reader_factors: Q: W_Q W_K^T,
# K: W_K W_Q^T, V: W_V W_O ("O": W_O^T)
_READS: dict[str, tuple[str, str]] = {"Q": ("Q", "K"), "K": ("K", "Q"), "V": ("V", "O")}


def reader_factors(w: AttentionWeights) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(A, B^T) of each reader matrix R = A B, per comp: A of K and V per KV head (shared by
    its query heads), everything else per query head."""
    W_K, _ = w.expanded_kv()
    W_Q, W_O = w.W_Q, w.W_O
    return {
        "Q": (W_Q, W_K),  # QK = W_Q W_K^T
        "K": (w.W_K, W_Q),  # QK^T = W_K W_Q^T
        "V": (w.W_V, W_O.transpose(-2, -1)),  # OV = W_V W_O
    }


def _gram_factor(G: torch.Tensor) -> torch.Tensor:
    """An R [..., k, k] with ``R^T R = G`` for a symmetric positive semi-definite G (a measured
    second moment): its Cholesky factor, or ``diag(sqrt(e)) V^T`` from its eigenvectors where G is
    singular. Either way ``||R X||_F = ||G^1/2 X||_F``."""
    with one_thread():
        R, info = torch.linalg.cholesky_ex(G, upper=True)
        bad = info != 0
        if bool(bad.any()):
            e, V = torch.linalg.eigh(G[bad])
            R[bad] = e.clamp_min(0).sqrt()[..., :, None] * V.transpose(-2, -1)
    return R


def head_factors(w: AttentionWeights, metric: Metric, comps: tuple[Comp, ...] = COMPS,
                 grams: dict[str, torch.Tensor] | None = None) -> HeadFactors:
    """Precompute everything per head (R factors, SVDs of d_head x d_head cores): once per model.

    ``grams`` (the activation space, ``compatlas.composition.activation_space``) replaces Gram matrices the
    kernel would take from the weights by measured second moments, [L, H or H / g, d_head, d_head]:
    ``"writer"`` the writer's ``W_V^T W_V``, ``"Q"`` / ``"K"`` the reader's other side (``W_K^T W_K``
    for Q, ``W_Q^T W_Q`` for K). ``subspace`` compares subspaces, which no moment changes."""
    if metric not in KERNEL_METRICS:  # pattern_output is a forward pass's (compatlas.composition.pattern_output)
        raise ValueError(f"the kernel does not score {metric!r}; it scores {KERNEL_METRICS}")
    grams = grams or {}
    W_Ot = w.W_O.transpose(-2, -1)  # [L, H, d_model, d_head]
    absorb: dict[str, torch.Tensor] = {}
    r_norm: dict[str, torch.Tensor] = {}
    r_sv: dict[str, torch.Tensor] = {}
    post: dict[str, torch.Tensor | None] = {}
    if metric == "subspace":
        readers = reader_factors(w)
        bases = _orthonormal_bases([W_Ot] + [readers[c][0] for c in comps])  # one batch of small SVDs
        U_O, keep_O = bases[0]
        emit = U_O.transpose(-2, -1)
        w_norm, w_sv = keep_O.sum(-1).sqrt(), keep_O
        for c, (U_A, keep_A) in zip(comps, bases[1:]):
            keep_A = keep_A.repeat_interleave(w.n_heads // U_A.shape[1], dim=1)
            absorb[c], r_norm[c], r_sv[c], post[c] = U_A, keep_A.sum(-1).sqrt(), keep_A, None
    else:
        # four R factors, one per weight (K and V per KV head), and two core spectra: the V
        # reader's core R_V R_O^T is the writer's, and K's R_K R_Q^T is Q's transposed (with
        # measured moments neither holds: each side then has its own factor and spectrum)
        mats = {"Q": w.W_Q, "K": w.W_K, "V": w.W_V, "O": W_Ot}
        need = {"V", "O"} | {x for c in comps for x in _READS[c]}
        R = {k: _r_factor(mats[k]) for k in sorted(need)}
        R_writer = _gram_factor(grams["writer"]) if "writer" in grams else R["V"]
        R_other = {c: _gram_factor(grams[c]) if c in grams else R[_READS[c][1]] for c in comps}

        def full(t: torch.Tensor) -> torch.Tensor:  # per query head
            return t.repeat_interleave(w.n_heads // t.shape[1], dim=1)

        # every core spectrum in one batch; a core once, in either order (the K core is Q's transposed)
        sides = [(R_writer, R["O"])] + [(R[_READS[c][0]], R_other[c]) for c in comps]
        keys = [(min(id(a), id(b)), max(id(a), id(b))) for a, b in sides]
        first = {key: i for i, key in reversed(list(enumerate(keys)))}
        with one_thread():
            made = dict(zip(first, _core_spectra([(full(sides[i][0]), full(sides[i][1])) for i in first.values()])))
        (w_norm, w_sv), *read = (made[key] for key in keys)
        emit = full(R_writer) @ w.W_O
        for c, (r_norm[c], r_sv[c]) in zip(comps, read):
            a = _READS[c][0]
            if mats[a].shape[1] == w.n_heads:
                absorb[c], post[c] = mats[a] @ full(R_other[c]).transpose(-2, -1), None
            else:  # shared A, per-query-head R_B^T: see the module docstring
                absorb[c], post[c] = mats[a], full(R_other[c]).transpose(-2, -1)
    cols = {c: a.permute(2, 0, 1, 3).reshape(a.shape[2], -1) for c, a in absorb.items()}
    return HeadFactors(metric, emit, w_norm, w_sv, absorb, r_norm, r_sv, post, cols)


def factor_family(metric: Metric) -> Metric:
    """The metric whose ``head_factors`` (and so whose core products) serve ``metric``: every metric
    scored from the Gram R factors and core spectra shares them, so a job scoring several computes
    the cores once (``composition_job``); ``subspace`` alone uses orthonormal bases."""
    return "subspace" if metric == "subspace" else "frobenius"


def pair_denominator(metric: Metric, w_norm, w_sv, r_norm, r_sv) -> torch.Tensor:
    """[H1, H2] denominators: the quantity ||L R||_F (or its square, for subspace) is divided by."""
    if metric == "frobenius":
        return w_norm[:, None] * r_norm[None, :]
    if metric == "contribution":  # a magnitude: nothing to divide by
        return torch.ones(w_norm.shape[0], r_norm.shape[0], dtype=w_norm.dtype, device=w_norm.device)
    if metric == "svd_bound":
        return (w_sv.pow(2) @ r_sv.pow(2).T).sqrt()
    # subspace: ||U1^T U2||_F^2 over the number of principal angles, min(rank1, rank2)
    r1, r2 = w_sv.sum(-1), r_sv.sum(-1)
    return torch.minimum(r1[:, None], r2[None, :]).clamp_min(1.0)


def normalised_score(metric: Metric, sq_norm: torch.Tensor, denom: torch.Tensor) -> torch.Tensor:
    """Score from the squared Frobenius norm of the core and the pair denominator."""
    if metric == "subspace":
        return sq_norm / denom
    return sq_norm.clamp_min(0).sqrt() / denom


def layer_pair_scores(f: HeadFactors, l1: int, readers: list[int], comp: Comp) -> torch.Tensor:
    """Scores [len(readers), H1, H2] of writer layer l1 into each reader layer, one GEMM."""
    return metrics_pair_scores(f, l1, readers, comp, (f.metric,))[f.metric]


def metrics_pair_scores(f: HeadFactors, l1: int, readers: list[int], comp: Comp,
                        metrics: Sequence[Metric]) -> dict[Metric, torch.Tensor]:
    """``layer_pair_scores`` of each of ``metrics``, which share ``f``'s factors (frobenius,
    svd_bound, contribution), from one GEMM: they differ only in their denominators."""
    E = f.gemm_emit()[l1]  # [H1, dh, d]
    H1, dh, d = E.shape
    L, Hg = f.absorb[comp].shape[:2]
    nR = len(readers)
    g, post = H1 // Hg, f.post.get(comp)  # query heads per absorb head
    cols = f.absorb_cols[comp]  # [d, L * Hg * dh]
    width = Hg * dh
    if nR and list(readers) == list(range(readers[0], readers[0] + nR)):  # consecutive layers: a view
        F = cols[:, readers[0] * width:(readers[0] + nR) * width]
    else:
        F = cols.view(d, L, width)[:, readers].reshape(d, nR * width)
    core = E.reshape(H1 * dh, d) @ F
    # squared Frobenius norms of the d_head x d_head blocks: squared in place, summed along the
    # contiguous axis first (the products are the bulk of the memory traffic)
    if post is None:  # per query head, or a subspace basis shared by the KV group
        sq = core.square_().view(H1, dh, nR * Hg, dh).sum(-1).sum(1)
        sq = sq.view(H1, nR, Hg).repeat_interleave(g, dim=2)  # [H1, nR, H2]
    else:  # each query head j of KV head k: core[.., k, :] @ post[k * g + j]
        core = core.view(H1 * dh, nR, Hg, dh).permute(1, 2, 0, 3)  # [nR, Hg, H1 dh, dh]
        P = post[readers].reshape(nR, Hg, g, dh, dh).permute(0, 1, 3, 2, 4).reshape(nR, Hg, dh, g * dh)
        sq = (core @ P).square_().view(nR, Hg, H1, dh, g, dh).sum(-1).sum(3)  # [nR, Hg, H1, g]
        sq = sq.permute(2, 0, 1, 3).reshape(H1, nR, Hg * g)  # [H1, nR, H2]
    # all reader layers' denominators at once: [H1, nR x H2]
    r_norm, r_sv = f.reader_norm[comp][readers], f.reader_sv[comp][readers]
    return {m: normalised_score(m, sq.reshape(H1, -1), pair_denominator(m, f.writer_norm[l1], f.writer_sv[l1],
                                                                     r_norm.reshape(-1), r_sv.reshape(r_norm.numel(), -1))
                                ).view(H1, nR, -1).transpose(0, 1).contiguous() for m in metrics}


# ----------------------------------------------------------------------------- layer pairs
# Which layer pairs a job scores: tiles of the layer grid (``compatlas.tiles``), kept
# importable from here, where the composition script and the benchmarks have always found them.
