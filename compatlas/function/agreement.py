"""How far a composition score agrees with function, and how sure that is.

The view ``composition_vs_function`` gives each metric x space x comp its point figures: the
Spearman of the score with |edge attribution| over a comp's edges, and the AUROC of the score for
the *top of the function* (the fewest edges holding half of the total |attribution|). This
module adds what a reader needs before trusting them (docs/statistics.md#agreement-with-function):

- ``measurability``: whether a comp has a function to predict at all. It needs at least
  ``MIN_EDGES`` edges (with fewer, a rank correlation spreads by more than 1/sqrt(n - 1) > 0.23
  by chance alone), at least ``MIN_TOP`` edges whose attribution differs from zero beyond its
  own standard error (a t-test over the attribution's sequences, Benjamini-Hochberg at
  ``SIGNAL_FDR`` over the comp's edges; a random-init model's attribution is all noise and has
  none), an effect of at least ``MIN_EFFECT`` nats in its largest edge (with enough sequences a
  random model's tiny effects become significant), and a top of the function of at least
  ``MIN_TOP`` edges (with one, an AUROC is the rank of one edge, not a sample: 4 edges and a top
  set of 1 give an AUROC of 0, 1/3, 2/3 or 1).
- ``bootstrap``: a paired bootstrap of AUROC and Spearman for every cell (metric x space) of one
  comp at once. Each replicate draws the edges with replacement (a multinomial weight per edge),
  re-derives the top of the function among them, and scores every cell on the same draw, so the
  difference between two cells has its own interval. Each edge keeps its measured attribution,
  noise and all: the interval is for the agreement with function as this many sequences measure
  it (measurement noise lowers it; the measurability gate keeps it from being all noise), over
  edges like these. Ranks under weights come from per-cell orders fixed once, O(edges) per cell
  per replicate. tests/test_agreement.py checks the intervals' coverage by simulation.
- ``best_and_ties``: the cell with the highest point figure, and the cells it does not beat
  beyond the uncertainty (the interval of the paired difference reaches 0).

The edges are treated as a sample of the edges such a model has; they are not independent
(edges share heads and sequences), which the report says where it shows the intervals.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats

from compatlas.multiple_testing import bh_q_values

MIN_EDGES = 20
MIN_TOP = 3
# nats: an edge whose patching moves the induced tokens' mean log-probability by less than this (1%)
# changes no prediction; with hundreds of sequences a random-init model's edges of 1e-4 nats and
# less become significant (toy-gpt2's V: 17 of 384 at 512 sequences), and are still not a function
MIN_EFFECT = 0.01
SIGNAL_FDR = 0.05
N_BOOT = 200
LEVEL = 0.95


@dataclass(frozen=True)
class Measurability:
    """Whether one comp's function can be predicted, and why not where it cannot."""

    n_edges: int
    n_top: int
    n_signal: int      # edges whose attribution differs from 0 (t-test, BH q <= SIGNAL_FDR)
    largest: float     # the largest |attribution|
    why: str | None    # None: measurable

    @property
    def measurable(self) -> bool:
        return self.why is None


def top_of_function(fn: np.ndarray, weights: np.ndarray | None = None, order: np.ndarray | None = None) -> np.ndarray:
    """The fewest edges holding half of the total ``fn`` (weighted by ``weights``): an edge is in
    it when the edges before it, largest first, hold less than half. Ties keep the given order
    (the view's: writer layer, writer head, reader layer, reader unit). ``order``: that order,
    ``np.argsort(-fn, kind="stable")``, from a caller that weights the same fn many times."""
    w = np.ones_like(fn) if weights is None else weights
    order = np.argsort(-fn, kind="stable") if order is None else order
    mass = (w * fn)[order]
    before = np.cumsum(mass) - mass
    top = np.zeros(fn.shape, dtype=bool)
    top[order] = before < 0.5 * mass.sum()
    return top & (w > 0)


def edge_p_values(attribution: np.ndarray, stderr: np.ndarray, n_sequences: int) -> np.ndarray:
    """Two-sided t-test p-value of each edge's mean attribution against 0 over ``n_sequences``
    sequences (its standard error given). An edge with a zero standard error gets p = 0 when its
    attribution is not zero (its sequences all agree) and 1 when it is; NaN where there is no error
    (fewer than 2 sequences)."""
    a, se = np.abs(np.asarray(attribution, dtype=float)), np.asarray(stderr, dtype=float)
    if n_sequences < 2:
        return np.full(a.shape, np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(se > 0, a / se, np.where(a > 0, np.inf, 0.0))
    return np.asarray(2 * stats.t.sf(t, df=n_sequences - 1), dtype=float)


def signal_edges(attribution: np.ndarray, stderr: np.ndarray, n_sequences: int) -> int:
    """How many edges carry an attribution distinguishable from zero: ``edge_p_values``,
    Benjamini-Hochberg over the edges at ``SIGNAL_FDR``."""
    if n_sequences < 2:
        return 0
    p = np.nan_to_num(edge_p_values(attribution, stderr, n_sequences), nan=1.0)
    return int((bh_q_values(p) <= SIGNAL_FDR).sum())


def measurability(attribution: np.ndarray, stderr: np.ndarray, n_sequences: int) -> Measurability:
    """``Measurability`` of one comp's edges (module docstring: the four conditions, in that order)."""
    a = np.asarray(attribution, dtype=float)
    n = len(a)
    n_top = int(top_of_function(np.abs(a)).sum()) if n else 0
    n_signal = signal_edges(a, stderr, n_sequences) if n else 0
    largest = float(np.abs(a).max()) if n else 0.0
    why = None
    if n < MIN_EDGES:
        why = (f"{n} edge{'s' if n != 1 else ''}, fewer than {MIN_EDGES}: too few to rank (a rank correlation over "
               f"them spreads by about {1 / np.sqrt(max(n - 1, 1)):.2f} by chance alone)")
    elif n_signal < MIN_TOP:
        why = (f"{n_signal} of its {n:,} edges carr{'ies' if n_signal == 1 else 'y'} an attribution distinguishable "
               f"from zero (t-test over {n_sequences} sequences, Benjamini-Hochberg q <= {SIGNAL_FDR:g}); the largest "
               f"|attribution| is {largest:.2g}")
    elif largest < MIN_EFFECT:
        why = (f"its largest |attribution| is {largest:.2g} nats, under {MIN_EFFECT:g} (a 1% change in the induced "
               f"tokens' probability): {n_signal} edge{'s' if n_signal != 1 else ''} distinguishable from zero, but too "
               "small to be a function")
    elif n_top < MIN_TOP:
        why = (f"the top of its function is {n_top} edge{'s' if n_top != 1 else ''}, fewer than {MIN_TOP}: an AUROC "
               "would be the rank of that edge, not a sample")
    return Measurability(n, n_top, n_signal, largest, why)


@dataclass(frozen=True)
class Agreement:
    """Point figures and bootstrap replicates of every cell of one comp (rows of ``scores``)."""

    auroc: np.ndarray           # (cells,)
    spearman: np.ndarray        # (cells,)
    auroc_boot: np.ndarray      # (cells, replicates)
    spearman_boot: np.ndarray   # (cells, replicates)

    def interval(self, which: str, level: float = LEVEL) -> tuple[np.ndarray, np.ndarray]:
        """The percentile interval of ``which`` ("auroc" or "spearman") per cell."""
        boot = self.auroc_boot if which == "auroc" else self.spearman_boot
        a = (1 - level) / 2
        with np.errstate(all="ignore"):
            lo, hi = np.nanquantile(boot, [a, 1 - a], axis=1) if boot.shape[1] else (np.full(len(boot), np.nan),) * 2
        return lo, hi


Ties = tuple[np.ndarray, np.ndarray]


def _ties(srt: np.ndarray) -> Ties:
    """The tie groups of each row of ``srt`` (rows x edges, each row ascending): per position, the
    flat indices of its group's start and end in a (rows, edges + 1) cumulative sum along the rows
    with a zero column first (``_group_bounds``). A row's first position starts a group."""
    n = srt.shape[1]
    new = np.ones(srt.shape, dtype=bool)
    new[:, 1:] = srt[:, 1:] != srt[:, :-1]
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], new.size)
    group = np.cumsum(new.ravel()) - 1
    # one more column per row before it; a group's end (one past its last position) is in its last position's row
    return (starts + starts // n)[group], (ends + (ends - 1) // n)[group]


def _group_bounds(counts_sorted: np.ndarray, ties: Ties) -> np.ndarray:
    """Per position of each row (whole weights in score order, ``ties`` its groups): the row's weight
    below its tie group plus that up to the group's end. Summed as integers, which numpy does ten
    times faster than floats: the same numbers (float64 sums of whole numbers are exact below 2**53)."""
    rows, n = counts_sorted.shape
    cum = np.zeros((rows, n + 1), dtype=np.int64)
    np.cumsum(counts_sorted, axis=1, out=cum[:, 1:])
    flat = cum.ravel()
    bounds = flat[ties[0]]
    bounds += flat[ties[1]]  # in place: a new array this size costs more (page faults) than the sum
    return bounds.reshape(rows, n)


def _counts(w: np.ndarray) -> np.ndarray:
    """``w``, an edge's weight in the sample (how many times it is drawn), as integers."""
    counts = w.astype(np.int64)
    if not np.array_equal(counts, w):
        raise ValueError("edge weights must be whole numbers: how many times each edge is drawn")
    return counts


def _fn_ranking(fn: np.ndarray) -> tuple[np.ndarray, Ties]:
    """fn's ascending order and its tie groups along that order (``_ties``)."""
    order = np.argsort(fn, kind="stable")
    return order, _ties(fn[order][None, :])


def _midranks(counts_sorted: np.ndarray, ties: Ties) -> np.ndarray:
    """Per row (cells x edges, each row in ascending order, ``ties`` its tie groups): each
    position's mid-rank in the sample that holds each edge ``w`` times: the weight below its tie
    group plus (its group's weight + 1) / 2."""
    bounds = _group_bounds(counts_sorted, ties)
    bounds += 1
    return bounds / 2  # below + (group + 1) / 2, exactly


@dataclass(frozen=True)
class _Cells:
    """Each cell's edges in ascending score order, fixed once for every replicate."""

    order: np.ndarray   # (cells, edges): edge indices, ascending score (no-score edges last)
    ties: Ties          # the tie groups along each row (``_ties``)
    valid: np.ndarray   # (cells, edges) in score order: the cell has a score for the edge
    all_valid: bool

    @classmethod
    def of(cls, scores: np.ndarray) -> _Cells:
        filled = np.where(np.isnan(scores), np.inf, scores)
        order = np.argsort(filled, axis=1, kind="stable")
        srt = np.take_along_axis(filled, order, axis=1)
        valid = np.isfinite(srt)
        return cls(order, _ties(srt), valid, bool(valid.all()))

    def drawn(self, counts: np.ndarray) -> _Drawn:
        """What every statistic of one weighting (``counts``, whole weights in edge order) shares: the
        cells' weights and weighted mid-ranks in score order, and their weighted sums."""
        cs = counts[self.order] if self.all_valid else counts[self.order] * self.valid
        ws = cs.astype(float)
        r_s = _midranks(cs, self.ties)
        sw, wr_s = ws.sum(axis=1), ws * r_s
        ms = wr_s.sum(axis=1) / sw
        with np.errstate(invalid="ignore", divide="ignore"):
            var_s = (wr_s * r_s).sum(axis=1) / sw - ms * ms
        return _Drawn(counts, cs, ws, r_s, sw, wr_s, ms, var_s)

    def score(self, w: np.ndarray, fn: np.ndarray, top: np.ndarray,
              fn_ranking: tuple[np.ndarray, Ties] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """AUROC and Spearman of every cell for one weighting ``w`` of the edges (how many times
        each is drawn) against ``fn``, ``top`` the top of the function under that weighting (all in
        edge order); ``fn_ranking``: ``_fn_ranking(fn)``, passed by a caller that scores the same
        fn many times."""
        auroc, rho, _ = self.against(self.drawn(_counts(w)), fn, top, fn_ranking)
        return auroc, rho

    def against(self, d: _Drawn, fn: np.ndarray, top: np.ndarray, fn_ranking: tuple[np.ndarray, Ties] | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``score`` of the weighting ``d`` (``drawn``), and fn's weighted mid-ranks in edge order where
        every cell has every edge (None otherwise)."""
        # AUROC: for each top edge, the weight of non-top edges scored below it, plus half of those tied
        top_s = top[self.order]
        pos = d.ws * top_s
        neg = d.ws - pos
        credit = _group_bounds(np.where(top_s, 0, d.cs), self.ties) / 2  # below + group / 2, exactly
        with np.errstate(invalid="ignore", divide="ignore"):
            auroc = (pos * credit).sum(axis=1) / (pos.sum(axis=1) * neg.sum(axis=1))
        # Spearman: the weighted Pearson of the weighted mid-ranks of score and of fn
        f_order, f_ties = _fn_ranking(fn) if fn_ranking is None else fn_ranking
        r_fn: np.ndarray | None = None
        if self.all_valid:  # every cell ranks fn over the same edges: once
            r_fn = np.empty(len(fn))
            r_fn[f_order] = _midranks(d.counts[f_order][None, :], f_ties)[0]
            r_f = r_fn[self.order]
        else:
            c, n = self.order.shape
            c_edge = np.zeros((c, n), dtype=np.int64)
            np.put_along_axis(c_edge, self.order, d.cs, axis=1)
            r_rows = np.empty((c, n))
            shift = (np.arange(c) * (n + 1))[:, None]  # fn's ties on each of c rows
            r_rows[:, f_order] = _midranks(c_edge[:, f_order], ((f_ties[0] + shift).ravel(), (f_ties[1] + shift).ravel()))
            r_f = np.take_along_axis(r_rows, self.order, axis=1)
        # from weighted sums (ranks below 1e9: float64 keeps these exact enough)
        wr_f = d.ws * r_f
        mf = wr_f.sum(axis=1) / d.sw
        with np.errstate(invalid="ignore", divide="ignore"):
            cov = (d.wr_s * r_f).sum(axis=1) / d.sw - d.ms * mf
            var_f = (wr_f * r_f).sum(axis=1) / d.sw - mf * mf
            rho = cov / np.sqrt(d.var_s * var_f)
        return auroc, rho, r_fn


@dataclass(frozen=True)
class _Drawn:
    """One weighting's arrays that a cell's statistics against any fn share (``_Cells.drawn``)."""

    counts: np.ndarray  # (edges,): whole weights, edge order
    cs: np.ndarray      # (cells, edges): the weights in each cell's score order (0 where it has no score)
    ws: np.ndarray      # cs as floats
    r_s: np.ndarray     # the cells' weighted mid-ranks, score order
    sw: np.ndarray      # (cells,): total weight
    wr_s: np.ndarray    # ws * r_s
    ms: np.ndarray      # (cells,): weighted mean rank
    var_s: np.ndarray   # (cells,): weighted rank variance


def _replicates(scores: np.ndarray, fn: np.ndarray, positives, n_boot: int, seed: int) -> Agreement:
    """Point AUROC (for ``positives(w)``, the positive edges under the weighting w) and Spearman
    (against ``fn``) of every row of ``scores``, and ``n_boot`` paired replicates."""
    scores = np.atleast_2d(np.asarray(scores, dtype=float))
    c, n = scores.shape
    cells = _Cells.of(scores)
    ranking = _fn_ranking(fn)  # fn is the same in every replicate: sorted once
    auroc, rho = cells.score(np.ones(n), fn, positives(np.ones(n)), ranking)
    rng = np.random.default_rng(seed)
    a_boot, r_boot = np.empty((c, n_boot)), np.empty((c, n_boot))
    for b in range(n_boot):
        w = np.bincount(rng.integers(0, n, n), minlength=n).astype(float)
        a_boot[:, b], r_boot[:, b] = cells.score(w, fn, positives(w), ranking)
    return Agreement(auroc, rho, a_boot, r_boot)


def bootstrap(scores: np.ndarray, attribution: np.ndarray, n_boot: int = N_BOOT, seed: int = 0) -> Agreement:
    """Point AUROC and Spearman of each row of ``scores`` (cells x edges; NaN: the cell has no
    score for that edge) against |attribution|, and ``n_boot`` paired replicates (module docstring)."""
    fn = np.abs(np.asarray(attribution, dtype=float))
    descending = np.argsort(-fn, kind="stable")  # the same in every replicate: sorted once
    return _replicates(scores, fn, lambda w: top_of_function(fn, w, descending), n_boot, seed)


def bootstrap_noise_aware(scores: np.ndarray, half_a: np.ndarray, half_b: np.ndarray, significant: np.ndarray,
                          n_boot: int = N_BOOT, seed: int = 0) -> Agreement:
    """As ``bootstrap``, on the statistics a noise scale cannot win (docs/edge_attribution.md):
    Spearman against ``half_a * half_b``, the product of two independent halves' mean attributions
    (unbiased for the squared function: no term grows with an edge's noise), and AUROC for the
    ``significant`` edges (attribution distinguishable from 0 after Benjamini-Hochberg), each
    edge carrying its own flag into the replicates."""
    fn = np.asarray(half_a, dtype=float) * np.asarray(half_b, dtype=float)
    sig = np.asarray(significant, dtype=bool)
    return _replicates(scores, fn, lambda w: sig & (w > 0), n_boot, seed)


def best_and_ties(point: np.ndarray, boot: np.ndarray, level: float = LEVEL) -> tuple[int, list[int]]:
    """The index of the highest ``point`` and the indices it does not beat beyond the
    uncertainty: those whose paired difference's lower ``level`` bound is not above 0."""
    point = np.asarray(point, dtype=float)
    best = int(np.nanargmax(point))
    tied = []
    for i in range(len(point)):
        if i == best or not np.isfinite(point[i]):
            continue
        d = boot[best] - boot[i]
        d = d[np.isfinite(d)]
        if not len(d) or np.quantile(d, (1 - level) / 2) <= 0:
            tied.append(i)
    return best, sorted(tied, key=lambda i: -point[i])
