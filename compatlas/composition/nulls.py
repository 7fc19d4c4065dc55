"""The two model-free nulls every composition score is stored beside (docs/math.md#nulls-which-pairs-compose-beyond-chance,
docs/statistics.md), their draws and their scores; the third, the model's own non-causal pairs, is
``calibration``'s.

- **Gaussian baseline** (``baseline_gaussian_mean``, ``_std``): the metric over the n x n pairs of
  n writer and n reader heads whose four factors are standard Gaussian, of the space's d_model and
  the model's d_head, by the same kernel as the real scores. What a score is against heads that
  learnt nothing. One pair of numbers per job and metric, the same for Q, K and V (one law:
  ``gaussian_baselines``), from one draw of heads per job shape (``gaussian_heads``).
- **Spectrum-kept baseline** (``baseline_spectrum_mean``, ``_std``): each pair's own singular
  values with uniformly random singular vectors in d_model dimensions, so
  ``||L R||_F^2 = s_L^2 (P o P) s_R^2`` with P the top d_head x d_head block of a uniformly random
  orthonormal frame (``haar_overlap_blocks``, drawn exactly in O(d_head^3)); it asks whether the
  pair's directions line up more than chance, given its spectra (``spectrum_baseline``). All pairs
  of a job share its n draws per metric x space x comp (common random numbers).

``draw_nulls`` draws both for one job on its device; ``composition.job.score_tiles`` scores them
beside the real pairs. ``n`` is ``composition.baseline_samples``. The Gaussian heads come from a
generator on the job's device (268M numbers at 70B widths); the spectrum null's few i.i.d. numbers
(0.5M a draw, 9 ms on one core) from the host's numpy generator, copied once to the device where
the draw's algebra runs (one way, no round trip), so that a CPU and a GPU job share the same
spectrum null (``tests/test_composition_job.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from compatlas.composition.scores import HeadFactors, head_factors, layer_pair_scores, normalised_score, pair_denominator
from compatlas.models.weights import AttentionWeights
from compatlas.runtime import free_bytes, one_thread_on, stable_seed
from compatlas.tiles import null_bytes
from compatlas.vocab import COMPS, Comp, Metric, Space

# ----------------------------------------------------------------------------- draws


def haar_overlap_blocks(d: int, k: int, n: int, seed: int, dtype: torch.dtype = torch.float64,
                        device: str | torch.device = "cpu") -> torch.Tensor:
    """n samples [n, k, k] of ``V^T U`` for independent uniformly random orthonormal frames V, U in R^{d x k}.

    By rotation invariance this is the top k x k block of one random frame. The Q factor of a
    Gaussian ``G = [G_top; G_rest]`` is such a frame, and its top block is ``G_top R^-1`` with
    ``R^T R = G_top^T G_top + G_rest^T G_rest``; the second term is Wishart, drawn by Bartlett's
    decomposition, so a sample costs O(k^3), never O(d k^2).
    """
    rng = np.random.default_rng(seed)  # numpy only draws numbers; the algebra runs in torch
    dof = d - k
    G_top = rng.standard_normal((n, k, k))
    if dof >= k:  # Bartlett: W = A A^T, A lower triangular, A_ii^2 ~ chi2(dof - i)
        A = np.tril(rng.standard_normal((n, k, k)), -1)
        idx = np.arange(k)
        A[:, idx, idx] = np.sqrt(rng.chisquare(dof - idx, size=(n, k)))
        A_t = torch.from_numpy(A).to(device)
        W_rest = A_t @ A_t.transpose(-2, -1)
    else:  # small d: draw G_rest itself
        G_rest = torch.from_numpy(rng.standard_normal((n, dof, k))).to(device)
        W_rest = G_rest.transpose(-2, -1) @ G_rest
    G_top_t = torch.from_numpy(G_top).to(device)
    L = torch.linalg.cholesky(G_top_t.transpose(-2, -1) @ G_top_t + W_rest)  # gram = L L^T, R = L^T
    P = torch.linalg.solve_triangular(L, G_top_t.transpose(-2, -1), upper=False).transpose(-2, -1)
    return P.to(dtype)


def spectrum_baseline(metric: Metric, w_norm, w_sv, r_norm, r_sv, P2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std [H1, H2] of each pair's score with its spectra kept and singular vectors random.

    ``||diag(s_L) P diag(s_R)||_F^2 = s_L^2 (P o P) s_R^2`` with P a random overlap block
    (``P2 = haar_overlap_blocks(...) ** 2``, [n, d_head, d_head]). All pairs share the n draws
    (common random numbers): each pair's n samples are still exact, and comparisons between
    pairs get sharper, at the cost of one einsum per layer pair.
    """
    a, b = (w_sv, r_sv) if metric == "subspace" else (w_sv.pow(2), r_sv.pow(2))
    sq = torch.einsum("wi,nij,rj->nwr", a, P2, b)
    scores = normalised_score(metric, sq, pair_denominator(metric, w_norm, w_sv, r_norm, r_sv))
    return scores.mean(0), scores.std(0)


def gaussian_baseline(metric: Metric, comp: Comp, d_model: int, d_head: int, n: int, seed: int,
                      dtype: torch.dtype = torch.float64, device: str | torch.device = "cpu") -> tuple[float, float]:
    """Mean and std of the score over n x n pairs of n writer and n reader heads with Gaussian factors
    of the model's shapes, computed by the same kernel as the real scores."""
    s = layer_pair_scores(head_factors(gaussian_heads(d_model, d_head, n, seed, dtype, device), metric, (comp,)),
                          0, [1], comp)
    return float(s.mean()), float(s.std())


def gaussian_heads(d_model: int, d_head: int, n: int, seed: int, dtype: torch.dtype = torch.float64,
                   device: str | torch.device = "cpu") -> AttentionWeights:
    """Standard Gaussian weights of two layers of n heads each: layer 0 the Gaussian baseline's
    writers, layer 1 its readers. Drawn in ``dtype`` by a generator on ``device`` (at 70B shapes
    they are 268M numbers: on a GPU, drawn there, never copied from the host); a GPU draws other
    numbers of the same law than the CPU."""
    g = torch.Generator(device=device).manual_seed(seed)

    def gauss(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=dtype, device=device)

    return AttentionWeights(
        W_Q=gauss(2, n, d_model, d_head), W_K=gauss(2, n, d_model, d_head),
        W_V=gauss(2, n, d_model, d_head), W_O=gauss(2, n, d_head, d_model),
        W_E=torch.zeros(1, d_model, dtype=dtype, device=device),
    )


@dataclass
class Nulls:
    """The nulls' draws of one job: each metric x comp's squared overlap blocks (the spectrum
    null, ``composition.spectrum_baseline``) and the Gaussian baseline's random heads."""

    P2: dict[tuple[Metric, Comp], torch.Tensor]
    gaussian: AttentionWeights


def draw_nulls(metrics: tuple[Metric, ...], space: Space, d_model: int, d_head: int, n: int, seed: int,
               dt: torch.dtype, dev: torch.device) -> Nulls:
    """The spectrum null's draws keep ``composition_table``'s seeds (one per metric x space x comp);
    the Gaussian heads are one draw per job shape, shared by every metric and comp. ValueError naming
    ``composition.baseline_samples`` where they would not fit the device's free memory (a model whose
    size validation could not know: it checks the others against composition.job_memory_gb)."""
    need, free = null_bytes(d_model, d_head, n, len(metrics), dt.itemsize), free_bytes(dev)
    if free is not None and need > free:
        raise ValueError(f"composition.baseline_samples: {n} needs about {need / 1e9:,.1f} GB for this job's nulls "
                         f"(d_model {d_model}, d_head {d_head}), more than the {free / 1e9:,.1f} GB free on {dev}; "
                         "lower it (the default is 32)")
    with one_thread_on(dev):
        P2 = {(m, c): haar_overlap_blocks(d_model, d_head, n, stable_seed(seed, "spectrum", m, space, c),
                                          device=dev).pow(2).to(dt) for m in metrics for c in COMPS}
    return Nulls(P2, gaussian_heads(d_model, d_head, n, stable_seed(seed, "gaussian", d_model, d_head), dt, dev))


# ----------------------------------------------------------------------------- the Gaussian baseline, by the job's kernel


def gaussian_baselines(heads: AttentionWeights, family: Metric, metrics: list[Metric],
                       sq_norms: Callable[[HeadFactors], torch.Tensor], small=nullcontext) -> torch.Tensor:
    """Mean and std [metrics, 2] of each metric's score over the n x n pairs of Gaussian heads
    (layer 0 writers, layer 1 readers), by the same kernel as the real scores: ``sq_norms`` is the
    job's (the squared Frobenius norms [n, n] of the Q cores of layer 0's heads into layer 1's, at
    the job's precision: ``composition.job.score_tiles``).

    Computed once, for Q, and given to K and V: with i.i.d. Gaussian weights the three comps'
    scores have one law (each reader matrix, ``W_Q W_K^T``, ``W_K W_Q^T`` or ``W_V W_O``, is a
    product of two independent Gaussian d_model x d_head factors; for ``subspace`` each reader
    subspace is the span of one), so three computations would be three estimates of one number."""
    f = head_factors(heads, family, ("Q",))
    sq = sq_norms(f)
    spectra = (f.writer_norm[0], f.writer_sv[0], f.reader_norm["Q"][1], f.reader_sv["Q"][1])
    with small():
        scores = [normalised_score(m, sq, pair_denominator(m, *spectra)) for m in metrics]
        return torch.stack([torch.stack([s.mean(), s.std()]) for s in scores])
