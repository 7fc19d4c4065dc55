"""The partial Spearman of a composition score with function beyond the two oracles (scale and
depth), and its paired bootstrap (docs/edge_attribution.md#what-composition-adds): the ranks of the
controls regressed out of a cell's ranks and of the function's by weighted least squares, the
correlation of what is left. Its replicates are drawn as ``agreement.bootstrap`` draws them."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from compatlas.function.agreement import LEVEL, N_BOOT, Ties, _Cells, _counts, _fn_ranking, _midranks


def _edge_ranks(cells: _Cells, counts: np.ndarray) -> np.ndarray:
    """Weighted mid-ranks (``_midranks``) of each cell, in edge order, a row per cell."""
    return in_edge_order(cells, _midranks(counts[cells.order], cells.ties))


def in_edge_order(cells: _Cells, ranks: np.ndarray) -> np.ndarray:
    """Each cell's ``ranks``, given in its score order, put back in edge order."""
    out = np.empty(cells.order.shape)
    np.put_along_axis(out, cells.order, ranks, axis=1)
    return out


def _residuals(y: np.ndarray, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The residuals of each row of ``y`` (rows x edges) after a weighted least-squares fit on an
    intercept and the rows of ``x`` (controls x edges), weights ``w`` (edges)."""
    design = np.vstack([np.ones(x.shape[1]), x])                     # (1 + controls, edges)
    gram = (design * w) @ design.T
    coef = np.linalg.lstsq(gram, (design * w) @ y.T, rcond=None)[0]  # (1 + controls, rows)
    return y - coef.T @ design


def _weighted_corr(a: np.ndarray, b: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted Pearson correlation of each row of ``a`` with ``b`` (one row, or as many as ``a``)."""
    sw = w.sum()
    ma, mb = (a * w).sum(axis=-1, keepdims=True) / sw, (b * w).sum(axis=-1, keepdims=True) / sw
    da, db = a - ma, b - mb
    with np.errstate(invalid="ignore", divide="ignore"):
        return (w * da * db).sum(axis=-1) / np.sqrt((w * da * da).sum(axis=-1) * (w * db * db).sum(axis=-1))


@dataclass(frozen=True)
class Partial:
    """The partial Spearman of every cell with the function beyond ``controls`` (their ranks
    regressed out of both the cell's ranks and the function's, by weighted least squares; the
    correlation of what is left), its bootstrap replicates, and the share of the function's rank
    variance the cell adds to the controls: ``partial**2 * (1 - R**2)``, R**2 the controls' own."""

    partial: np.ndarray         # (cells,)
    added_r2: np.ndarray        # (cells,)
    controls_r2: float
    partial_boot: np.ndarray    # (cells, replicates)

    def interval(self, level: float = LEVEL) -> tuple[np.ndarray, np.ndarray]:
        a = (1 - level) / 2
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore", RuntimeWarning)  # a cell with no partial (a control): NaN bounds
            lo, hi = np.nanquantile(self.partial_boot, [a, 1 - a], axis=1)
        return lo, hi


def _partial_once(cells: _Cells, ctrl: _Cells, fn_order: np.ndarray, fn_ties: Ties, w: np.ndarray,
                  r_s: np.ndarray | None = None, r_f: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, float]:
    """(partial per cell, added R**2 per cell, the controls' R**2) under one weighting ``w``; ``r_s``,
    ``r_f``: the cells' and fn's weighted mid-ranks in edge order, from a caller that has them."""
    n, counts = len(w), _counts(w)
    r_s = _edge_ranks(cells, counts) if r_s is None else r_s
    r_c = _edge_ranks(ctrl, counts)
    if r_f is None:
        r_f = np.empty(n)
        r_f[fn_order] = _midranks(counts[fn_order][None, :], fn_ties)[0]
    res_f = _residuals(r_f[None, :], r_c, w)[0]
    res_s = _residuals(r_s, r_c, w)
    part = _weighted_corr(res_s, res_f[None, :], w)
    var_f = _weighted_corr(r_f[None, :], r_f[None, :], w)  # 1 unless constant
    with np.errstate(invalid="ignore", divide="ignore"):
        sw = w.sum()
        c_r2 = 1 - (w * res_f**2).sum() / (w * (r_f - (w * r_f).sum() / sw) ** 2).sum()
    # a cell the controls span (one of them) has nothing left to correlate: its residual is rounding
    left = (w * res_s**2).sum(axis=1) > 1e-9 * (w * (r_s - (w * r_s).sum(axis=1, keepdims=True) / w.sum()) ** 2).sum(axis=1)
    part = np.where(cells.valid.all(axis=1) & np.isfinite(var_f) & left, part, np.nan)
    return part, part**2 * (1 - c_r2), float(c_r2)


def bootstrap_partial(scores: np.ndarray, fn: np.ndarray, controls: np.ndarray, n_boot: int = N_BOOT,
                      seed: int = 0) -> Partial:
    """The partial Spearman of each row of ``scores`` (cells x edges) with ``fn`` beyond the rows
    of ``controls`` (e.g. the scale and depth oracles), and ``n_boot`` paired replicates drawn as
    ``bootstrap`` draws them (the same seed gives the same draws). A cell with a missing score, or
    a cell that is one of the controls, has no partial (NaN)."""
    scores = np.atleast_2d(np.asarray(scores, dtype=float))
    controls = np.atleast_2d(np.asarray(controls, dtype=float))
    fn = np.asarray(fn, dtype=float)
    c, n = scores.shape
    cells, ctrl = _Cells.of(scores), _Cells.of(controls)
    fn_order, fn_ties = _fn_ranking(fn)
    part, added, c_r2 = _partial_once(cells, ctrl, fn_order, fn_ties, np.ones(n))
    rng = np.random.default_rng(seed)
    boot = np.empty((c, n_boot))
    for b in range(n_boot):
        w = np.bincount(rng.integers(0, n, n), minlength=n).astype(float)
        boot[:, b] = _partial_once(cells, ctrl, fn_order, fn_ties, w)[0]
    return Partial(part, added, c_r2, boot)
