"""The invariance audit (Snell's Axiom 4, docs/math.md#the-invariance-audit): do scores survive a
change of residual basis?

``x -> x T`` leaves the network's function unchanged when every writer is multiplied by T on
the right and every reader by T^-1 on the left (norms ignored: the linear setting):
``W_O -> W_O T``, ``W_E -> W_E T``, ``W_Q, W_K, W_V -> T^-1 W``, ``W_U -> T^-1 W_U``.
For each class of T we recompute every metric in every space and compare with the
untransformed scores: Spearman rank correlation, max absolute change, top-k overlap.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import polars as pl
import torch

from compatlas.composition.scores import HeadFactors, head_factors, layer_pairs, metrics_pair_scores
from compatlas.composition.token_space import to_space
from compatlas.models.weights import AttentionWeights
from compatlas.progress import Progress
from compatlas.runtime import stable_seed
from compatlas.tables import INVARIANCE_SCHEMA
from compatlas.vocab import COMPS, KERNEL_METRICS, TRANSFORMS, WEIGHT_SPACES, Metric, Space, Transform

log = logging.getLogger(__name__)


def random_transform(kind: Transform, d: int, seed: int, log10_range: float = 2.0) -> torch.Tensor:
    """A random d x d T of the class (float64). Scales are log-uniform in 10^[-r, r]."""
    g = torch.Generator().manual_seed(seed)

    def haar() -> torch.Tensor:
        Q, R = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
        return Q * torch.sign(torch.diagonal(R))

    def log_uniform(n: int) -> torch.Tensor:
        return 10 ** ((2 * torch.rand(n, generator=g, dtype=torch.float64) - 1) * log10_range)

    if kind == "permutation":
        return torch.eye(d, dtype=torch.float64)[torch.randperm(d, generator=g)]
    if kind == "orthogonal":
        return haar()
    if kind == "orthogonal_scale":
        return log_uniform(1) * haar()
    if kind == "diagonal":
        return torch.diag(log_uniform(d))
    if kind == "gl":
        return haar() @ torch.diag(log_uniform(d)) @ haar()
    raise ValueError(f"unknown transform class {kind!r}; choose from {TRANSFORMS}")


def apply_transform(w: AttentionWeights, T: torch.Tensor) -> AttentionWeights:
    """The same network in the residual basis x T (norms ignored)."""
    T = T.to(w.W_Q)
    T_inv = torch.linalg.inv(T)
    # W_E = Q R gives W_E T = Q (R T): the token factor follows exactly, with no new QR.
    # token_norm's row normalisation does not commute with T, so its factor is recomputed.
    extras = {"R_token": w.extras["R_token"] @ T.to(w.extras["R_token"])} if "R_token" in w.extras else {}
    return AttentionWeights(
        W_Q=T_inv @ w.W_Q, W_K=T_inv @ w.W_K, W_V=T_inv @ w.W_V, W_O=w.W_O @ T,
        W_E=None if w.W_E is None else w.W_E @ T,
        W_U=None if w.W_U is None else T_inv @ w.W_U, meta=w.meta, extras=extras,
    )


def model_scores(ws: AttentionWeights, metric: Metric, pairs: list[tuple[int, int]] | None = None,
                 factors: HeadFactors | None = None) -> dict[str, torch.Tensor]:
    """Pair scores of a model already in its space (no nulls), per comp, in a fixed pair order."""
    f = head_factors(ws, metric) if factors is None else replace(factors, metric=metric)
    return shared_scores(ws, f, [metric], pairs)[metric]


def shared_scores(ws: AttentionWeights, f: HeadFactors, metrics: list[Metric], pairs: list[tuple[int, int]] | None = None
                  ) -> dict[Metric, dict[str, torch.Tensor]]:
    """``model_scores`` of each of ``metrics``, which share the factors ``f``: one GEMM per layer and comp for all."""
    pairs = layer_pairs(list(range(ws.n_layers))) if pairs is None else pairs
    readers: dict[int, list[int]] = {}
    for l1, l2 in pairs:
        readers.setdefault(l1, []).append(l2)
    out: dict[Metric, dict[str, list[torch.Tensor]]] = {m: {c: [] for c in COMPS} for m in metrics}
    for l1, rs in sorted(readers.items()):
        for c in COMPS:
            for m, s in metrics_pair_scores(f, l1, rs, c, metrics).items():
                out[m][c].append(s.flatten())
    return {m: {c: torch.cat(v) if v else torch.zeros(0) for c, v in per.items()} for m, per in out.items()}


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    if len(a) < 2:
        return float("nan")
    ra = pl.Series(a).rank("average").to_numpy()
    rb = pl.Series(b).rank("average").to_numpy()
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def compare(before: np.ndarray, after: np.ndarray, top_k: int) -> dict[str, float | bool]:
    k = min(top_k, len(before))
    top_b = set(np.argsort(-before, kind="stable")[:k])
    top_a = set(np.argsort(-after, kind="stable")[:k])
    overlap = len(top_b & top_a) / k if k else float("nan")
    return {"spearman": spearman(before, after), "max_abs_change": float(np.abs(after - before).max()) if k else 0.0,
            "top_k": k, "top_k_overlap": overlap, "top_k_kept": bool(overlap == 1.0)}


def sample_layers(layers: list[int], n: int) -> list[int]:
    """n layers spread evenly from the first to the last (all of them when n is 0 or covers them).

    The audit scores every pair among them: per-head factors are then needed for n layers only."""
    if n <= 0 or n >= len(layers):
        return list(layers)
    return [layers[round(i * (len(layers) - 1) / (n - 1))] for i in range(n)] if n > 1 else [layers[0]]


def scores_all_metrics(ws: AttentionWeights, metrics: list[Metric]) -> dict[str, dict[str, torch.Tensor]]:
    """Every metric's scores on one model; frobenius, svd_bound and contribution share their per-head
    factors and their products (``shared_scores``), subspace has its own."""
    together: list[Metric] = [m for m in metrics if m != "subspace"]
    out = shared_scores(ws, head_factors(ws, "frobenius"), together) if together else {}
    return {m: model_scores(ws, m) if m == "subspace" else out[m] for m in metrics}


def audit(w: AttentionWeights, metrics: list[Metric], spaces: list[Space], *,
          transforms: tuple[Transform, ...] = TRANSFORMS, top_k: int = 20, seed: int = 0, log10_range: float = 2.0,
          layers: list[int] | None = None, max_condition: float = 1e6) -> pl.DataFrame:
    """One row per transform class x metric x space x comp, over every head pair of the given
    layers (all by default). Runs in float64 so that what changes is the metric, not rounding."""
    w64 = (w if layers is None else w.layers(layers)).to("cpu", torch.float64)
    # norms ignored: the symmetry holds exactly only in the linear setting. The stored token_norm
    # factor folds the first norm's weight, so drop it too: both sides recompute it alike.
    w64.ln1_w = None
    w64.W_U = None  # not read by any metric; saves a d_model x d_vocab product per transform
    w64.extras = {k: v for k, v in w64.extras.items() if k != "R_token_norm"}
    # the untransformed scores once; then one transformed model at a time (memory: two models)
    spaces = [s for s in spaces if s in WEIGHT_SPACES]  # activation's invariance: tests/test_activation_space.py
    metrics = [m for m in metrics if m in KERNEL_METRICS]  # pattern_output is no weight space's
    base = {s: scores_all_metrics(to_space(w64, s, max_condition)[0], metrics) for s in spaces}
    rows = []
    progress = Progress(log, "invariance audit", total=len(transforms) * len(spaces), unit="transform x space")
    for kind in transforms:
        wt = apply_transform(w64, random_transform(kind, w.d_model, stable_seed(seed, "invariance", kind), log10_range))
        for space in spaces:
            moved = scores_all_metrics(to_space(wt, space, max_condition)[0], metrics)
            for metric in metrics:
                for c in COMPS:
                    rows.append({"transform": kind, "metric": metric, "space": space, "comp": c,
                                 **compare(base[space][metric][c].numpy(), moved[metric][c].numpy(), top_k)})
            progress.advance()
    return pl.DataFrame(rows).with_columns(
        pl.lit(w.meta.get("model", "?")).alias("model"), pl.lit(w.meta.get("checkpoint", "final")).alias("checkpoint"),
        pl.lit(w.meta.get("processing", "none")).alias("processing"), pl.lit(log10_range).alias("log10_scale_range"),
    ).select(list(INVARIANCE_SCHEMA))

