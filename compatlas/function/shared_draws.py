"""One comp's three paired bootstraps on one set of draws: ``agreement.bootstrap`` against
|attribution|, and where the attribution has split halves ``agreement.bootstrap_noise_aware`` and
``partial_agreement.bootstrap_partial`` (against their product, beyond the controls). Each draws the
same weights from the same seed over the same edges, so drawing them once, and ranking each cell
once per draw for all three, gives the numbers each gives alone, bit for bit (the same arrays in
the same arithmetic, tests/test_agreement.py), for a quarter less work. The replicates can be
computed in parts, on threads (``CompDraws.part``): a part starts from the generator's state at its
first replicate, so the draws are those of one sequence."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from itertools import pairwise
from typing import Any

import numpy as np

from compatlas.function.agreement import N_BOOT, Agreement, _Cells, _counts, _fn_ranking, top_of_function
from compatlas.function.partial_agreement import Partial, _partial_once, in_edge_order

Result = tuple[Agreement, Agreement | None, Partial | None]


@dataclass(frozen=True)
class Halves:
    """The split halves' mean attributions, and which edges are significant (``bootstrap_noise_aware``)."""

    half_a: np.ndarray
    half_b: np.ndarray
    significant: np.ndarray


class CompDraws:
    """The cells and functions of one comp, ranked once, and its replicates from ``seed``."""

    def __init__(self, scores: np.ndarray, attribution: np.ndarray, halves: Halves | None, controls: np.ndarray,
                 n_boot: int = N_BOOT, seed: int = 0):
        scores = np.atleast_2d(np.asarray(scores, dtype=float))
        self.shape, self.n_boot, self.seed, self.halves = scores.shape, n_boot, seed, halves
        self.cells = _Cells.of(scores)
        self.fn = np.abs(np.asarray(attribution, dtype=float))
        self.descending, self.ranking = np.argsort(-self.fn, kind="stable"), _fn_ranking(self.fn)
        if halves is not None:
            self.fn_u = np.asarray(halves.half_a, dtype=float) * np.asarray(halves.half_b, dtype=float)
            self.sig, self.ranking_u = np.asarray(halves.significant, dtype=bool), _fn_ranking(self.fn_u)
            self.ctrl = _Cells.of(np.atleast_2d(np.asarray(controls, dtype=float)))

    def figures(self, w: np.ndarray) -> list[np.ndarray]:
        """Each statistic's figure per cell under the weighting ``w``: AUROC and Spearman against
        |attribution|, then (with halves) the noise-aware pair, the partial, its added R**2, the controls' R**2."""
        cells = self.cells
        d = cells.drawn(_counts(w))
        auroc, rho, _ = cells.against(d, self.fn, top_of_function(self.fn, w, self.descending), self.ranking)
        if self.halves is None:
            return [auroc, rho]
        auroc_u, rho_u, r_fn = cells.against(d, self.fn_u, self.sig & (w > 0), self.ranking_u)
        # the cells' ranks in edge order, from the same draw (with a missing score, _partial_once ranks its own)
        r_s = in_edge_order(cells, d.r_s) if cells.all_valid else None
        part, added, c_r2 = _partial_once(cells, self.ctrl, *self.ranking_u, w, r_s, r_fn)
        return [auroc, rho, auroc_u, rho_u, part, added, np.array(c_r2)]

    def parts(self, k: int) -> list[Callable[[], np.ndarray]]:
        """The replicates in ``k`` parts (fewer where there are fewer replicates), each a call that
        returns its (statistics, cells, replicates) block; ``result`` puts them together in order."""
        rng = np.random.default_rng(self.seed)
        n, bounds = self.shape[1], np.linspace(0, self.n_boot, max(1, min(k, self.n_boot)) + 1).astype(int)
        calls: list[Callable[[], np.ndarray]] = []
        for start, stop in pairwise(bounds):
            calls.append(partial(self._part, int(stop - start), rng.bit_generator.state))
            for _ in range(start, stop):  # on to the next part's first draw: the integers only, not the weights
                rng.integers(0, n, n)
        return calls

    def _part(self, count: int, state: Mapping[str, Any]) -> np.ndarray:
        rng = np.random.default_rng()
        rng.bit_generator.state = state
        n = self.shape[1]
        out = np.empty((2 if self.halves is None else 5, self.shape[0], count))
        for b in range(count):
            w = np.bincount(rng.integers(0, n, n), minlength=n).astype(float)
            for replicates, figure in zip(out, self.figures(w), strict=False):
                replicates[:, b] = figure
        return out

    def result(self, parts: list[np.ndarray]) -> Result:
        """(``bootstrap``'s Agreement, and with halves ``bootstrap_noise_aware``'s and ``bootstrap_partial``'s
        results, else None) from the parts' blocks in order (``parts``)."""
        point = self.figures(np.ones(self.shape[1]))
        boot = np.concatenate(parts, axis=2) if parts else np.empty((len(point[:5]), self.shape[0], 0))
        agreement = Agreement(point[0], point[1], boot[0], boot[1])
        if self.halves is None:
            return agreement, None, None
        return (agreement, Agreement(point[2], point[3], boot[2], boot[3]),
                Partial(point[4], point[5], float(point[6]), boot[4]))


def bootstrap_comp(scores: np.ndarray, attribution: np.ndarray, halves: Halves | None, controls: np.ndarray,
                   n_boot: int = N_BOOT, seed: int = 0, parts: int = 1) -> Result:
    """(``bootstrap(scores, attribution)``, and with ``halves`` ``bootstrap_noise_aware(scores, *halves)``
    and ``bootstrap_partial(scores, half_a * half_b, controls)``, else None), from one set of draws, in
    ``parts`` (the same numbers however many)."""
    draws = CompDraws(scores, attribution, halves, controls, n_boot, seed)
    return draws.result([part() for part in draws.parts(parts)])
