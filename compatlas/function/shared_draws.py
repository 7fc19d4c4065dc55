"""One comp's three paired bootstraps on one set of draws: ``agreement.bootstrap`` against
|attribution|, and where the attribution has split halves ``agreement.bootstrap_noise_aware`` and
``partial_agreement.bootstrap_partial`` (against their product, beyond the controls). Each draws the
same weights from the same seed over the same edges, so drawing them once, and ranking each cell
once per draw for all three, gives the numbers each gives alone, bit for bit (the same arrays in
the same arithmetic, tests/test_agreement.py), for about two thirds of the work."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from compatlas.function.agreement import N_BOOT, Agreement, _Cells, _counts, _fn_ranking, top_of_function
from compatlas.function.partial_agreement import Partial, _partial_once


@dataclass(frozen=True)
class Halves:
    """The split halves' mean attributions, and which edges are significant (``bootstrap_noise_aware``)."""

    half_a: np.ndarray
    half_b: np.ndarray
    significant: np.ndarray


def bootstrap_comp(scores: np.ndarray, attribution: np.ndarray, halves: Halves | None, controls: np.ndarray,
                   n_boot: int = N_BOOT, seed: int = 0) -> tuple[Agreement, Agreement | None, Partial | None]:
    """(``bootstrap(scores, attribution)``, and with ``halves`` ``bootstrap_noise_aware(scores, *halves)``
    and ``bootstrap_partial(scores, half_a * half_b, controls)``, else None), from one set of draws."""
    scores = np.atleast_2d(np.asarray(scores, dtype=float))
    c, n = scores.shape
    cells = _Cells.of(scores)
    fn = np.abs(np.asarray(attribution, dtype=float))
    descending, ranking = np.argsort(-fn, kind="stable"), _fn_ranking(fn)
    if halves is not None:
        fn_u = np.asarray(halves.half_a, dtype=float) * np.asarray(halves.half_b, dtype=float)
        sig, ranking_u = np.asarray(halves.significant, dtype=bool), _fn_ranking(fn_u)
        ctrl = _Cells.of(np.atleast_2d(np.asarray(controls, dtype=float)))

    def once(w: np.ndarray) -> list[np.ndarray]:
        """Each statistic's figure per cell under the weighting ``w``: AUROC and Spearman against
        |attribution|, then (with halves) the noise-aware pair, the partial, its added R**2, the controls' R**2."""
        d = cells.drawn(_counts(w))
        auroc, rho, _ = cells.against(d, fn, top_of_function(fn, w, descending), ranking)
        if halves is None:
            return [auroc, rho]
        auroc_u, rho_u, r_fn = cells.against(d, fn_u, sig & (w > 0), ranking_u)
        r_s = None
        if cells.all_valid:  # the cells' ranks in edge order (partial_agreement._edge_ranks), from the same draw
            r_s = np.empty(cells.order.shape)
            np.put_along_axis(r_s, cells.order, d.r_s, axis=1)
        part, added, c_r2 = _partial_once(cells, ctrl, *ranking_u, w, r_s, r_fn)
        return [auroc, rho, auroc_u, rho_u, part, added, np.array(c_r2)]

    point = once(np.ones(n))
    boot = [np.empty((c, n_boot)) for _ in range(2 if halves is None else 5)]  # the replicates of point[:5]
    rng = np.random.default_rng(seed)
    for b in range(n_boot):
        w = np.bincount(rng.integers(0, n, n), minlength=n).astype(float)
        for replicates, figure in zip(boot, once(w), strict=False):
            replicates[:, b] = figure
    agreement = Agreement(point[0], point[1], boot[0], boot[1])
    if halves is None:
        return agreement, None, None
    return (agreement, Agreement(point[2], point[3], boot[2], boot[3]),
            Partial(point[4], point[5], float(point[6]), boot[4]))
