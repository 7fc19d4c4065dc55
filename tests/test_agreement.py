"""compatlas.function.agreement: the point figures against scipy, the weighted ranks against a sample
with the edges repeated, the bootstrap intervals' coverage and the measurability gate's false
positive rate by simulation, and best / tied on constructed cells."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from compatlas.function import agreement as ag
from compatlas.function.partial_agreement import _edge_ranks, bootstrap_partial
from compatlas.function.shared_draws import Halves, bootstrap_comp


def _auroc(score: np.ndarray, top: np.ndarray) -> float:
    return stats.mannwhitneyu(score[top], score[~top]).statistic / (top.sum() * (~top).sum())


def test_point_figures_are_mann_whitney_and_spearman_with_ties_and_missing_scores():
    rng = np.random.default_rng(1)
    n = 80
    scores = np.round(rng.normal(size=(3, n)), 1)  # rounded: ties
    scores[2, :9] = np.nan                          # a cell without a score for some edges
    a = rng.normal(size=n) * np.exp(rng.normal(size=n))
    fn, got = np.abs(a), ag.bootstrap(scores, a, n_boot=0)
    top = ag.top_of_function(fn)
    # the top of the function: the fewest edges holding half the total, by hand
    srt = np.sort(fn)[::-1]
    assert top.sum() == int(np.argmax(np.cumsum(srt) >= 0.5 * fn.sum())) + 1
    for i in range(3):
        v = ~np.isnan(scores[i])
        assert got.auroc[i] == pytest.approx(_auroc(scores[i][v], top[v]), abs=1e-12)
        assert got.spearman[i] == pytest.approx(stats.spearmanr(scores[i][v], fn[v]).statistic, abs=1e-12)


def test_weights_are_the_sample_with_each_edge_repeated():
    rng = np.random.default_rng(2)
    n = 60
    scores, fn = np.round(rng.normal(size=(2, n)), 1), np.exp(rng.normal(size=n))
    w = rng.integers(0, 4, n).astype(float)
    auroc, rho = ag._Cells.of(scores).score(w, fn, ag.top_of_function(fn, w))
    idx = np.repeat(np.arange(n), w.astype(int))
    top = ag.top_of_function(fn[idx])
    assert top.sum() == ag.top_of_function(fn, w)[idx].sum()
    for i in range(2):
        assert auroc[i] == pytest.approx(_auroc(scores[i][idx], top), abs=1e-12)
        assert rho[i] == pytest.approx(stats.spearmanr(scores[i][idx], fn[idx]).statistic, abs=1e-12)


def test_weighted_midranks_are_exact_and_weights_are_draw_counts():
    """Mid-ranks under weights are summed as integers (numpy's cumulative float sum is ten times
    slower): exactly scipy's average ranks in the sample with each edge repeated, not merely close;
    a weight that is not a whole number (a count of draws) is refused rather than truncated."""
    rng = np.random.default_rng(3)
    n = 300
    score = np.round(rng.normal(size=(1, n)), 1)  # ties
    w = rng.integers(0, 4, n).astype(float)
    cells = ag._Cells.of(score)
    got = _edge_ranks(cells, w.astype(np.int64))[0]
    idx = np.repeat(np.arange(n), w.astype(int))
    ranks = stats.rankdata(score[0][idx])  # an edge's copies tie: each has the edge's mid-rank
    first = np.searchsorted(idx, np.flatnonzero(w))
    assert np.array_equal(got[w > 0], ranks[first])
    with pytest.raises(ValueError, match="whole numbers"):
        cells.score(w + 0.5, np.abs(score[0]), w > 0)


def _population(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Heavy-tailed function (log-normal, as attribution is) and a score that tracks it noisily."""
    fn = np.exp(rng.normal(0, 1.5, n)) * 0.01
    return np.log(fn) + rng.normal(0, 2.0, n), fn


def test_intervals_cover_the_population_value_95_percent_of_the_time():
    score, fn = _population(400_000, np.random.default_rng(99))
    truth = ag.bootstrap(score, fn, n_boot=0)
    rng, reps = np.random.default_rng(0), 120
    covered = {"auroc": 0, "spearman": 0}
    for r in range(reps):
        s, f = _population(300, rng)
        res = ag.bootstrap(s, f, n_boot=200, seed=r)
        for which in covered:
            lo, hi = res.interval(which)
            covered[which] += bool(lo[0] <= getattr(truth, which)[0] <= hi[0])
    # 95% nominal; with 120 datasets a calibrated interval lands in [0.89, 0.99] with probability ~0.99
    for which, k in covered.items():
        assert 0.89 <= k / reps <= 0.995, (which, k / reps)


def test_best_and_ties():
    rng = np.random.default_rng(3)
    n = 400
    fn = np.exp(rng.normal(0, 1.5, n))
    good = np.log(fn) + rng.normal(0, 0.3, n)
    scores = np.stack([rng.normal(size=n), good, rng.normal(size=n), good + 1e-9 * rng.normal(size=n)])
    res = ag.bootstrap(scores, fn)
    best, tied = ag.best_and_ties(res.auroc, res.auroc_boot)
    assert best in (1, 3) and tied == [4 - best]        # the two near-copies tie; the random cells are beaten
    res = ag.bootstrap(scores[:3], fn)
    assert ag.best_and_ties(res.auroc, res.auroc_boot) == (1, [])


def test_measurability_gate():
    rng = np.random.default_rng(4)
    few = ag.measurability(np.array([-2.0, -0.1, 0.05, 0.01]), np.full(4, 0.01), 16)
    assert not few.measurable and "4 edges, fewer than 20" in few.why
    # a planted function: 6 edges far beyond their standard error among 300 noise edges
    a = rng.normal(0, 0.01, 300)
    a[:6] = -1.0
    planted = ag.measurability(a, np.full(300, 0.01), 16)
    by_hand = int(np.argmax(np.cumsum(np.sort(np.abs(a))[::-1]) >= 0.5 * np.abs(a).sum())) + 1  # 5 of the 6
    assert planted.measurable and planted.n_signal >= 6 and planted.n_top == by_hand >= ag.MIN_TOP
    # five edges carry it, one of them nearly all: a top of 1 is not a sample
    a1 = rng.normal(0, 0.01, 300)
    a1[:5] = [-50.0, -0.5, -0.5, -0.5, -0.5]
    one = ag.measurability(a1, np.full(300, 0.01), 16)
    assert not one.measurable and "top of its function is 1 edge" in one.why
    # a single sequence has no standard error: nothing can be told from zero
    assert ag.signal_edges(a, np.zeros(300), 1) == 0
    # many sequences make a random model's tiny effects significant: the effect floor still says no function
    tiny = ag.measurability(a * 1e-4, np.full(300, 1e-6), 512)
    assert tiny.n_signal >= 6 and not tiny.measurable and f"under {ag.MIN_EFFECT:g}" in tiny.why


def test_the_gate_rarely_finds_function_in_noise():
    """Pure noise (each edge's mean over 16 sequences of N(0, 1) draws): the gate needs 3 edges past
    Benjamini-Hochberg at 0.05, so a random-init model passes it well under 5% of the time."""
    rng, reps, passed = np.random.default_rng(5), 300, 0
    for _ in range(reps):
        x = rng.normal(0, 1, (16, 200))
        passed += ag.measurability(x.mean(0), x.std(0, ddof=1) / 4, 16).measurable
    assert passed / reps <= 0.03, passed


def _measured(n: int, rng: np.random.Generator, sequences: int = 16) -> dict[str, np.ndarray]:
    """Edges whose noise scale (sd over sequences) is log-normal and independent of their function,
    as for edges with large activations and no role: per edge the mean over ``sequences`` of
    f + sd * N(0, 1), its standard error and the means over the even and the odd sequences."""
    f = rng.normal(0, 1, n) * np.exp(rng.normal(0, 1.0, n)) * 0.2
    sd = np.exp(rng.normal(0, 1.0, n))
    x = f[None, :] + sd[None, :] * rng.normal(0, 1, (sequences, n))
    return {"f": f, "sd": sd, "mean": x.mean(0), "se": x.std(0, ddof=1) / np.sqrt(sequences),
            "a": x[0::2].mean(0), "b": x[1::2].mean(0)}


def test_the_scale_oracle_wins_abs_attribution_but_not_the_unbiased_estimate():
    """Function independent of noise scale: ranking edges by their standard error (which knows
    nothing of f) correlates strongly with |mean attribution|, the statistic a noise scale wins,
    and not with a x b, the split halves' product (unbiased for f^2); a score that tracks |f|
    wins the second. (a x b is unbiased in value, not in rank: the wide products of noisy edges
    spread to both tails, which here gives the scale a small negative Spearman, never a credit.)"""
    e = _measured(20_000, np.random.default_rng(7))
    scale, knows = e["se"], np.abs(e["f"])
    assert stats.spearmanr(scale, np.abs(e["mean"])).statistic > 0.35
    assert stats.spearmanr(scale, e["a"] * e["b"]).statistic < 0.02
    assert stats.spearmanr(knows, e["a"] * e["b"]).statistic > 0.3
    res = ag.bootstrap_noise_aware(np.stack([scale, knows]), e["a"], e["b"], np.zeros(len(scale), bool), n_boot=0)
    assert res.spearman == pytest.approx([stats.spearmanr(scale, e["a"] * e["b"]).statistic,
                                          stats.spearmanr(knows, e["a"] * e["b"]).statistic], abs=1e-12)


def test_noise_aware_intervals_cover_the_population_value():
    """The paired bootstrap's 95% intervals of Spearman with a x b and of AUROC for the significant
    edges cover the population figure (the same measurement on 200,000 edges) about 95% of the time."""
    def cell(e: dict) -> tuple[np.ndarray, np.ndarray]:
        score = np.log(np.abs(e["f"]) + 1e-3) + np.random.default_rng(len(e["f"])).normal(0, 1.0, len(e["f"]))
        sig = ag.bh_q_values(ag.edge_p_values(e["mean"], e["se"], 16)) <= 0.05
        return score, sig

    pop = _measured(200_000, np.random.default_rng(11))
    score, sig = cell(pop)
    truth = ag.bootstrap_noise_aware(score, pop["a"], pop["b"], sig, n_boot=0)
    rng, reps = np.random.default_rng(12), 120
    covered = {"auroc": 0, "spearman": 0}
    for r in range(reps):
        e = _measured(1500, rng)
        s, g = cell(e)
        res = ag.bootstrap_noise_aware(s, e["a"], e["b"], g, n_boot=200, seed=r)
        for which in covered:
            lo, hi = res.interval(which)
            covered[which] += bool(lo[0] <= getattr(truth, which)[0] <= hi[0])
    for which, k in covered.items():
        assert 0.89 <= k / reps <= 0.995, (which, k / reps)


def test_partial_spearman_beyond_controls_is_the_ranks_regressed_out():
    """partial_agreement.bootstrap_partial against scipy's ranks, numpy's least squares and Pearson; a control
    itself has no partial; the interval holds the point figure; and the method's limit, kept in sight:
    a blend of the controls with no function of its own still shows a partial, since ranks of a sum
    are not linear in the ranks of its parts (docs/edge_attribution.md#what-composition-adds)."""
    rng = np.random.default_rng(1)
    n = 500
    depth = rng.normal(size=n)
    scale = rng.normal(size=n) + 0.5 * depth
    fn = depth + scale + 0.5 * rng.normal(size=n)
    good = fn + 2 * rng.normal(size=n)                     # carries fn beyond the controls
    proxy = depth + scale + 0.01 * rng.normal(size=n)      # the controls, blended
    scores = np.vstack([good, proxy, scale])
    p = bootstrap_partial(scores, fn, np.vstack([scale, depth]), n_boot=100)
    rank = stats.rankdata
    design = np.column_stack([np.ones(n), rank(scale), rank(depth)])

    def left(y):
        return y - design @ np.linalg.lstsq(design, y, rcond=None)[0]

    want = [stats.pearsonr(left(rank(s)), left(rank(fn)))[0] for s in scores[:2]]
    assert p.partial[:2] == pytest.approx(want, abs=1e-10)
    assert np.isnan(p.partial[2])  # a control: nothing left to correlate
    lo, hi = p.interval()
    assert (lo[:2] <= p.partial[:2]).all() and (p.partial[:2] <= hi[:2]).all() and lo[0] > 0
    r2 = 1 - (left(rank(fn)) ** 2).sum() / ((rank(fn) - rank(fn).mean()) ** 2).sum()
    assert p.controls_r2 == pytest.approx(r2, abs=1e-10) and p.added_r2[0] == pytest.approx(want[0] ** 2 * (1 - r2))
    assert p.partial[1] > 0.3  # the limit: the blend "adds" 0.40 here


@pytest.mark.parametrize(("missing", "parts"), [(False, 1), (True, 1), (False, 4), (True, 7)])
def test_shared_draws_give_each_bootstrap_bit_for_bit(missing, parts):
    """shared_draws.bootstrap_comp, the three bootstraps of a comp on one set of draws, gives exactly
    the arrays each gives alone (same draws, same arithmetic), ties and cells with missing scores too,
    and so do its replicates computed in parts (as the atlas computes them, on threads)."""
    rng = np.random.default_rng(5)
    n = 400
    half_a, half_b = rng.normal(size=n), rng.normal(size=n)
    attribution = (half_a + half_b) / 2
    scores = np.round(np.vstack([np.abs(attribution) + rng.normal(size=n), rng.normal(size=n),
                                 np.repeat(rng.normal(size=n // 8), 8), np.abs(half_a), rng.normal(size=n)]), 2)
    if missing:
        scores[1, ::9] = np.nan
    significant = rng.random(n) < 0.2
    controls = scores[[3, 4]]
    together = bootstrap_comp(scores, attribution, Halves(half_a, half_b, significant), controls, n_boot=30, seed=2,
                              parts=parts)
    alone = (ag.bootstrap(scores, attribution, n_boot=30, seed=2),
             ag.bootstrap_noise_aware(scores, half_a, half_b, significant, n_boot=30, seed=2),
             bootstrap_partial(scores, half_a * half_b, controls, n_boot=30, seed=2))
    for got, want in zip(together, alone, strict=True):
        for field in want.__dataclass_fields__:
            g, w = getattr(got, field), getattr(want, field)
            assert np.asarray(g).tobytes() == np.asarray(w).tobytes(), field
    only, noise, part = bootstrap_comp(scores, attribution, None, controls, n_boot=30, seed=2, parts=parts)
    assert noise is None and part is None and only.auroc_boot.tobytes() == alone[0].auroc_boot.tobytes()
