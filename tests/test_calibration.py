"""Calibrated composition: p-values against the model's own non-causal pairs, BH q-values.

The p-value and q-value formulas are checked against brute force and a hand-worked case; the
tail model against distributions whose survival function is known; calibration itself on
random models, where causal and non-causal pairs are exchangeable (so P(p <= a) <= a), and
power on a random model with one planted K-composition circuit. In grouped-query models the
unit of each cell's tests (query head or KV head) is checked against the kernel's scores, the
calibration over distinct tests, and a planted circuit into a KV head counted once.
"""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
import torch
from conftest import random_moments
from conftest import random_weights as shared_random_weights

from compatlas.composition.calibration import (
    KV_SHARED_RTOL,
    NULL_PAIRS,
    NullPairs,
    bh_q_values,
    calibrate,
    calibrate_shards,
    empirical_p_values,
    hypothesis_unit,
    tail_survival,
)
from compatlas.composition.scores import block_pairs, layer_pairs, null_pairs
from compatlas.composition.table import score_block
from compatlas.models.weights import AttentionWeights
from compatlas.storage import write_shard
from compatlas.vocab import COMPS, KERNEL_METRICS, NORMALISED_METRICS, SPACES


def test_empirical_p_is_the_counting_formula():
    rng = np.random.default_rng(0)
    null = rng.normal(size=500)
    scores = np.concatenate([rng.normal(size=200), null[:20]])  # ties with the null count as >=
    p = empirical_p_values(scores, null, tail=False)
    brute = np.array([(1 + sum(x >= s for x in null)) / (1 + len(null)) for s in scores])
    np.testing.assert_array_equal(p, brute)
    # the tail model only touches scores beyond the null's maximum, and only lowers their floor
    above = np.concatenate([scores, [null.max() + 0.5, null.max() + 2.0]])
    p_tail = empirical_p_values(above, null, tail=True)
    inside = above <= null.max()
    np.testing.assert_array_equal(p_tail[:len(scores)], brute)
    assert np.all(p_tail[~inside] <= 1 / (1 + len(null))) and p_tail[-1] < p_tail[-2]
    assert np.isnan(empirical_p_values(np.array([np.nan]), null)[0])
    assert empirical_p_values(np.array([0.3]), np.array([]))[0] == 1.0


def test_bh_q_values_hand_worked_and_brute_force():
    # sorted p: .005 .01 .03 .04, m = 4: p m / rank = .02 .02 .04 .04, then the running min from the top
    np.testing.assert_allclose(bh_q_values(np.array([0.01, 0.04, 0.03, 0.005])), [0.02, 0.04, 0.04, 0.02])
    p = np.random.default_rng(1).uniform(size=60) ** 3
    m = len(p)
    rank = {i: r + 1 for r, i in enumerate(np.argsort(p, kind="stable"))}
    brute = [min(1.0, min(p[j] * m / rank[j] for j in range(m) if p[j] >= p[i])) for i in range(m)]
    np.testing.assert_allclose(bh_q_values(p), brute)
    q = bh_q_values(np.array([0.5, np.nan, 0.001]))
    assert np.isnan(q[1]) and q[2] == pytest.approx(0.002)


@pytest.mark.parametrize("xi", [0.0, 0.3])
def test_tail_model_is_a_conservative_estimate_of_a_known_survival_function(xi):
    """Generalised Pareto nulls of 20,000 scores, p read at true survival 1e-4 (two null scores
    beyond), 1e-5 and 2e-6 (5x and 25x past the empirical floor, where BH needs them): the
    tail's p is at least the truth (to 0.1 decade) in 9 of 10 draws, and within 1.5 decades of it
    in the median draw. The plain MLE of the shape is too small there by over a decade in about 1 of 20 draws."""
    from scipy import stats

    truth = np.array([1e-4, 1e-5, 2e-6])
    x = stats.genpareto.isf(truth, xi)
    err = []
    for seed in range(10):
        null = stats.genpareto.rvs(xi, size=20_000, random_state=np.random.default_rng(seed))
        p = empirical_p_values(x, null)
        assert np.all(np.diff(p) < 0)
        err.append(np.log10(p) - np.log10(truth))
    err = np.array(err)
    assert np.all((err >= -0.1).sum(axis=0) >= 9), err
    assert np.all(np.median(err, axis=0) <= 1.5), err


def test_a_bounded_null_tail_is_extrapolated_conservatively():
    """Uniform null: nothing can exceed 1, yet p beyond it stays positive, decreasing, and the
    exponential extrapolation never calls a score just past the bulk more extreme than the data do."""
    null = np.random.default_rng(3).uniform(size=5000)
    fit = tail_survival(null)
    assert fit is not None and fit[2] == 0.0  # shape clamped to the exponential
    p = empirical_p_values(np.array([0.999, 1.0, 1.05, 1.2]), null)
    assert np.all(p > 0) and np.all(np.diff(p) <= 0) and p[3] < p[1]
    assert p[0] == (1 + np.sum(null >= 0.999)) / (1 + len(null))  # inside the null: the counting p
    assert tail_survival(null[:50]) is None  # too few to model: the empirical floor stays


# ----------------------------------------------------------------------------- on models


def random_weights(seed: int, L: int = 6, H: int = 6, Hkv: int = 6, d: int = 48, dh: int = 8,
                   vocab: int = 300) -> AttentionWeights:
    """Gaussian heads with a random spectrum and scale per head (so the metrics' normalisations
    matter), iid across layers: causal and non-causal pairs are exchangeable."""
    return shared_random_weights(seed, L=L, H=H, Hkv=Hkv, d=d, dh=dh, spectrum=0.5, scale=0.5, vocab=vocab,
                                 embed_decades=0.5, unembed=True, ln1=0.1, meta={"model": "random", "norm_type": "RMS"})


def moments_of(w: AttentionWeights, seed: int = 0):
    """Random activation moments of the model's shapes (the activation space's statistics)."""
    return random_moments(w.n_layers, w.n_heads, w.n_kv_heads, w.d_head, seed)


def score_and_calibrate(w: AttentionWeights, metric: str, space: str,
                        designs: tuple[NullPairs, ...] = ("mirror",)) -> dict[NullPairs, pl.DataFrame]:
    """p and q of every causal pair, once per null design, from one scoring of all pairs."""
    layers = list(range(w.n_layers))
    df, _ = score_block(w, metric, space, layer_pairs(layers) + null_pairs(layers, 1, 0), baseline_samples=2,
                        device="cpu", dtype="float64", moments=moments_of(w) if space == "activation" else None)
    causal = pl.col("writer_layer") < pl.col("reader_layer")
    g = w.n_heads // w.n_kv_heads
    return {design: calibrate(df.filter(causal), df.filter(~causal), null_pairs=design, kv_group=g) for design in designs}


def distinct_tests(pq: pl.DataFrame) -> pl.DataFrame:
    """One row per test of a calibration table: a KV head's test once, not once per query head."""
    unit = pl.when(pl.col("test_unit") == "kv_head").then(-1 - pl.col("reader_kv_head")).otherwise(pl.col("reader_head"))
    return pq.with_columns(unit.alias("_test")).unique(
        ["metric", "space", "comp", "writer_layer", "writer_head", "reader_layer", "_test"], keep="first", maintain_order=True)


def test_null_pairs_mirror_each_block_and_share_the_same_layer_pairs():
    """Each job's null is the mirror of its causal pairs plus the same-layer pairs of its diagonal
    tiles (compatlas/tiles.py): pooled over a model's jobs, every same-layer pair once."""
    layers = [0, 2, 3, 5]
    for blocks in (1, 2, 3, 4, 7, 10, 12):
        jobs = [null_pairs(layers, blocks, b) for b in range(blocks)]
        for b, job in enumerate(jobs):
            assert {(r, w) for w, r in job if w != r} == set(block_pairs(layers, blocks, b))
        assert sorted(p for job in jobs for p in job if p[0] == p[1]) == [(la, la) for la in layers]


def test_null_rows_exclude_self_pairs():
    w = random_weights(0, L=3, H=4, Hkv=2)
    df, _ = score_block(w, "frobenius", "residual", [(1, 1), (2, 0)], baseline_samples=2, device="cpu", dtype="float64")
    same = df.filter(pl.col("writer_layer") == pl.col("reader_layer"))
    assert same.height == 3 * 4 * 3 and (same["writer_head"] != same["reader_head"]).all()
    assert df.filter(pl.col("writer_layer") == 2).height == 3 * 16


def test_random_models_are_calibrated_in_every_metric_space_and_comp():
    """On random models the share of causal pairs with p <= 0.01 is 0.01 within the spread of chance.

    6 layers x 6 heads: 540 causal pairs per metric x space x comp, against N = 540 mirror pairs
    (the default null) or N = 720 with the same-layer pairs (both designs checked). With scores
    exchangeable, P(p <= 0.01) = floor(0.01 (N + 1)) / (N + 1) exactly, and since all causal pairs
    share one null the count is beta-binomial (conformal p-values), not binomial; pairs that
    share a head add a little more (measured over 60 models in 3 metric x space cells: variance
    1.23 to 1.34 times the beta-binomial's, mean 5.25 to 5.56 against 5.24 expected). Each of the
    48 cells (4 metrics x 4 spaces x 3 comps; the activation space on random moments) sums 8 models and must lie
    within 4 of those standard deviations of the expectation.
    That band reaches 0 on the low side, so a needlessly conservative null is caught apart: no
    cell may be empty (P(k = 0) = P_model(0)^8, with P_model(0) about 0.03 for the beta-binomial:
    about 1e-12), and over all 48 cells the count must be at least half its expectation (the cells'
    counts are correlated, the same models: at worst perfectly, so the pooled sd is at most 48 cell
    sd's, a quarter of the pooled mean, and half the mean lies 2 of those below it)."""
    from scipy import stats

    n_models, m, alpha = 8, 540, 0.01
    n_nulls: dict[NullPairs, int] = {"mirror": 540, "mirror_and_same_layer": 720}
    rows = []
    for seed in range(n_models):
        w = random_weights(seed)
        for metric in KERNEL_METRICS:
            for space in SPACES:
                for design, pq in score_and_calibrate(w, metric, space, NULL_PAIRS).items():
                    assert (pq["n_null"] == n_nulls[design]).all()
                    rows.append(pq.group_by("comp").agg(pl.len().alias("m"), (pl.col("p_value") <= alpha).sum().alias("k"))
                                .with_columns(pl.lit(metric).alias("metric"), pl.lit(space).alias("space"),
                                              pl.lit(design).alias("design")))
    cells = pl.concat(rows).group_by("design", "metric", "space", "comp").agg(pl.col("m").sum(), pl.col("k").sum())
    assert cells.height == 2 * len(KERNEL_METRICS) * len(SPACES) * len(COMPS) and (cells["m"] == n_models * m).all()
    for design, n_null in n_nulls.items():
        a = math.floor(alpha * (n_null + 1))
        per_model = stats.betabinom(m, a, n_null + 1 - a)
        mean, sd = n_models * per_model.mean(), math.sqrt(n_models * per_model.var() * 1.35)
        cell = cells.filter(pl.col("design") == design)
        for k, name in zip(cell["k"], cell["metric"] + "/" + cell["space"] + "/" + cell["comp"]):
            assert abs(k - mean) <= 4 * sd, (f"{design} {name}: {k} of {n_models * m} causal pairs with p <= {alpha} "
                                             f"(expected {mean:.1f} +- {sd:.1f})")
            assert k >= 1, f"{design} {name}: no causal pair at p <= {alpha}: a conservative null"
        assert cell["k"].sum() >= 0.5 * mean * cell.height, (design, int(cell["k"].sum()), mean * cell.height)
        assert per_model.pmf(0) ** n_models < 1e-9  # the empty-cell check above cannot fail by chance


def same_norm(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    return new * (old.norm() / new.norm())


def plant_k_circuit(w: AttentionWeights, writer: tuple[int, int], reader: tuple[int, int], rank: int = 2,
                    seed: int = 0) -> None:
    """The writer head writes only into a ``rank``-dim subspace S (its W_O rows span S) and the
    reader's keys read only S (W_K's rows span S): a K-composition circuit by construction, as a
    previous-token head writes a few directions that an induction head's keys read. Both keep
    their Frobenius norms, as a real model's heads do (a magnitude, ``contribution``, would
    otherwise see a smaller head; the normalised metrics see no scale)."""
    g = torch.Generator().manual_seed(seed)
    d, dh = w.d_model, w.d_head
    S = torch.linalg.qr(torch.randn(d, rank, generator=g, dtype=torch.float64)).Q  # [d, rank]
    (l1, h1), (l2, h2) = writer, reader
    w.W_O[l1, h1] = same_norm(torch.randn(dh, rank, generator=g, dtype=torch.float64) @ S.T, w.W_O[l1, h1])
    w.W_K[l2, h2] = same_norm(S @ torch.randn(rank, dh, generator=g, dtype=torch.float64), w.W_K[l2, h2])


def test_a_planted_circuit_is_the_discovery_in_every_metric_and_space():
    w = random_weights(11, L=6, H=8, Hkv=8)
    plant_k_circuit(w, writer=(1, 3), reader=(4, 5))
    for metric in NORMALISED_METRICS:  # contribution: the next test
        for space in SPACES:
            found = score_and_calibrate(w, metric, space)["mirror"].filter((pl.col("comp") == "K") & (pl.col("q_value") <= 0.05))
            pairs = set(zip(found["writer_layer"], found["writer_head"], found["reader_layer"], found["reader_head"]))
            assert (1, 3, 4, 5) in pairs, f"{metric}/{space}: the planted pair is no discovery"
            assert len(pairs) <= 2, f"{metric}/{space}: {sorted(pairs)}"


def test_a_planted_circuit_has_the_largest_contribution_where_heads_share_a_scale():
    """A magnitude sees head sizes: with per-head scales exp(0.5 N(0, 1)) (the test above) big
    heads outweigh the plant. Where the heads share one scale the planted pair has the largest K
    contribution and the smallest p in every space; it is no discovery at q <= 0.05 on these 540
    pairs, since a magnitude's null is heavy-tailed (products of norms): its p is about 1e-4."""
    for seed in (11, 12):
        w = shared_random_weights(seed, L=6, H=8, Hkv=8, d=48, dh=8, spectrum=0.5, vocab=300, embed_decades=0.5,
                                  unembed=True, ln1=0.1, meta={"model": "random", "norm_type": "RMS"})
        plant_k_circuit(w, writer=(1, 3), reader=(4, 5))
        for space in SPACES:
            pq = score_and_calibrate(w, "contribution", space)["mirror"].filter(pl.col("comp") == "K")
            first = pq.sort("p_value", "writer_layer", "writer_head", "reader_layer", "reader_head").row(0, named=True)
            assert (first["writer_layer"], first["writer_head"], first["reader_layer"], first["reader_head"]) == (1, 3, 4, 5), space
            assert first["p_value"] < 1e-3 and (pq["p_value"] > first["p_value"]).sum() == pq.height - 1, space


def test_calibrate_shards_matches_calibrate_on_whole_tables(tmp_path):
    w = random_weights(5, L=4, H=4, Hkv=2)
    layers, paths = list(range(4)), {"causal": [], "null": []}
    whole = []
    for metric in ("frobenius", "subspace"):
        for b in range(2):
            df, _ = score_block(w, metric, "residual", block_pairs(layers, 2, b) + null_pairs(layers, 2, b),
                                baseline_samples=2, device="cpu", dtype="float64")
            whole.append(df)
            for kind, rows in (("causal", df.filter(pl.col("writer_layer") < pl.col("reader_layer"))),
                               ("null", df.filter(pl.col("writer_layer") >= pl.col("reader_layer")))):
                path = tmp_path / kind / f"metric={metric}" / "space=residual" / f"block={b}.parquet"
                path.parent.mkdir(parents=True, exist_ok=True)
                rows.write_parquet(path)
                paths[kind].append(str(path))
    df = pl.concat(whole)
    causal = pl.col("writer_layer") < pl.col("reader_layer")
    expected = calibrate(df.filter(causal), df.filter(~causal), kv_group=2).sort(
        "metric", "comp", "writer_layer", "writer_head", "reader_layer", "reader_head")
    got = pl.concat(list(calibrate_shards(paths["causal"], paths["null"], kv_group=2))).sort(expected.columns[:10])
    assert got.sort("metric", "comp", "writer_layer", "writer_head", "reader_layer", "reader_head").equals(expected)


def test_distance_strata_use_only_null_pairs_at_the_same_distance():
    w = random_weights(2, L=4, H=3, Hkv=3)
    layers = list(range(4))
    df, _ = score_block(w, "frobenius", "residual", layer_pairs(layers) + null_pairs(layers, 1, 0),
                        baseline_samples=2, device="cpu", dtype="float64")
    causal = pl.col("writer_layer") < pl.col("reader_layer")
    pq = calibrate(df.filter(causal), df.filter(~causal), stratify="distance", kv_group=1)
    row = pq.filter((pl.col("comp") == "Q") & (pl.col("writer_layer") == 0) & (pl.col("reader_layer") == 3)).row(0, named=True)
    null = df.filter((pl.col("comp") == "Q") & (pl.col("writer_layer") == 3) & (pl.col("reader_layer") == 0))
    score = df.filter(causal & (pl.col("comp") == "Q") & (pl.col("writer_layer") == 0) & (pl.col("reader_layer") == 3)
                      & (pl.col("writer_head") == row["writer_head"]) & (pl.col("reader_head") == row["reader_head"]))["score"][0]
    assert row["n_null"] == 9
    assert row["p_value"] == pytest.approx((1 + int((null["score"] >= score).sum())) / 10)


# ----------------------------------------------------------------------------- grouped-query attention


def within_group_spread(df: pl.DataFrame, g: int) -> pl.DataFrame:
    """Per cell: the largest relative spread of the scores of one writer head over the g query
    heads of one reader KV head, and the smallest (0 where some KV group's scores coincide)."""
    spread = df.group_by("metric", "space", "comp", "writer_layer", "writer_head", "reader_layer",
                         pl.col("reader_head") // g).agg(
        ((pl.col("score").max() - pl.col("score").min()) / pl.col("score").abs().max()).alias("rel"))
    return spread.group_by("metric", "space", "comp").agg(pl.col("rel").max().alias("max_rel"),
                                                          pl.col("rel").min().alias("min_rel"))


def test_every_cell_tests_the_unit_its_scores_have_in_a_gqa_model():
    """A GQA model (8 query heads, 2 KV heads, g = 4), every metric x space x comp scored by the
    kernel: where hypothesis_unit says 'kv_head' the scores of a KV group's query heads are one
    value, elsewhere they differ in every group; the calibration then holds each KV head's test
    once in the family (BH over the distinct tests) and in the null (N per KV head), every query
    head of the group carrying the same p and q."""
    L, H, Hkv = 4, 8, 2
    g = H // Hkv
    w = random_weights(21, L=L, H=H, Hkv=Hkv)
    layers = list(range(L))
    causal = pl.col("writer_layer") < pl.col("reader_layer")
    n_layer_pairs = L * (L - 1) // 2
    units = {}
    for metric in KERNEL_METRICS:
        for space in SPACES:
            df, _ = score_block(w, metric, space, layer_pairs(layers) + null_pairs(layers, 1, 0), baseline_samples=2,
                                device="cpu", dtype="float64", moments=moments_of(w) if space == "activation" else None)
            for row in within_group_spread(df, g).iter_rows(named=True):
                unit = hypothesis_unit(metric, row["comp"], g)
                units[metric, space, row["comp"]] = unit
                if unit == "kv_head":
                    assert row["max_rel"] <= KV_SHARED_RTOL, (metric, space, row)
                else:  # per query head: no KV group of any writer gives its query heads one score
                    assert row["min_rel"] > 1e-3, (metric, space, row)
            for design in NULL_PAIRS:
                pq = calibrate(df.filter(causal), df.filter(~causal), null_pairs=design, kv_group=g)
                assert pq.height == n_layer_pairs * H * H * len(COMPS)  # a row per query head
                for (comp,), cell in pq.group_by("comp"):
                    unit = units[metric, space, comp]
                    assert (cell["test_unit"] == unit).all()
                    assert (cell["reader_kv_head"] == cell["reader_head"] // g).all()
                    tests = distinct_tests(cell)
                    per_reader = Hkv if unit == "kv_head" else H
                    assert tests.height == n_layer_pairs * H * per_reader
                    # every row of one test: one p, one q
                    keys = ["writer_layer", "writer_head", "reader_layer", "reader_kv_head" if unit == "kv_head" else "reader_head"]
                    assert cell.group_by(keys).agg(pl.col("p_value").n_unique(), pl.col("q_value").n_unique()).select(
                        pl.col("p_value").max(), pl.col("q_value").max()).row(0) == (1, 1)
                    # the null: mirror pairs once per test, plus (stricter design) same-layer pairs of
                    # a writer with another KV group (or another query head), self pairs excluded
                    same_layer = L * H * ((Hkv - 1) if unit == "kv_head" else (H - 1))
                    n_null = n_layer_pairs * H * per_reader + (same_layer if design == "mirror_and_same_layer" else 0)
                    assert (cell["n_null"] == n_null).all(), (metric, space, comp, design)
                    # q is BH over the distinct tests, not over the rows
                    np.testing.assert_allclose(tests["q_value"].to_numpy(), bh_q_values(tests["p_value"].to_numpy()))
    assert {k for k, u in units.items() if u == "kv_head"} == {("subspace", s, c) for s in SPACES for c in ("K", "V")}
    # without grouped-query attention every cell's test is its query head's
    assert all(hypothesis_unit(m, c, 1) == "query_head" for m in KERNEL_METRICS for c in COMPS)


def test_a_kv_head_test_whose_scores_differ_is_refused():
    w = random_weights(3, L=3, H=4, Hkv=2)
    layers = list(range(3))
    df, _ = score_block(w, "subspace", "residual", layer_pairs(layers) + null_pairs(layers, 1, 0), baseline_samples=2,
                        device="cpu", dtype="float64")
    causal = pl.col("writer_layer") < pl.col("reader_layer")
    bumped = df.with_columns(pl.when(causal & (pl.col("reader_head") == 1) & (pl.col("comp") == "K"))
                             .then(pl.col("score") * 1.01).otherwise(pl.col("score")).alias("score"))
    with pytest.raises(ValueError, match="score differently"):
        calibrate(bumped.filter(causal), bumped.filter(~causal), kv_group=2)


def test_random_gqa_models_are_calibrated_per_distinct_test():
    """As test_random_models_are_calibrated_in_every_metric_space_and_comp, on GQA models (6 query
    heads, 2 KV heads, g = 3) and in cells of both units: subspace (Q per query head, K and V per
    KV head) and frobenius (all per query head), residual and token space, both null designs.
    A KV head's test counts once: m = N = 180 tests per cell (15 layer pairs x 6 writers x 2 KV
    heads; 216 null tests with the same-layer pairs), against 540 / 720 for query-head tests.
    The spread: measured over 60 such models (seeds 100 to 159, subspace residual and frobenius
    token), the count's variance is 0.5 to 1.3 times the beta-binomial's in the subspace cells and
    frobenius Q, and 1.3 to 2.5 times in frobenius K and V, whose query-head tests of one KV group
    share that group's W_K or W_V (dependent tests, the same mean: 5.0 to 5.5 against 5.0 to 5.2
    expected); so the factor is 2.6 there and 1.35 elsewhere, as above."""
    from scipy import stats

    n_models, alpha = 8, 0.01
    expect = {("query_head", "mirror"): (540, 540), ("query_head", "mirror_and_same_layer"): (540, 720),
              ("kv_head", "mirror"): (180, 180), ("kv_head", "mirror_and_same_layer"): (180, 216)}
    rows = []
    for seed in range(n_models):
        w = random_weights(100 + seed, H=6, Hkv=2)
        for metric in ("subspace", "frobenius"):
            for space in ("residual", "token"):
                for design, pq in score_and_calibrate(w, metric, space, NULL_PAIRS).items():
                    rows.append(distinct_tests(pq).group_by("comp", "test_unit").agg(
                        pl.len().alias("m"), pl.col("n_null").max().alias("n_null"),
                        (pl.col("p_value") <= alpha).sum().alias("k"))
                        .with_columns(pl.lit(metric).alias("metric"), pl.lit(space).alias("space"),
                                      pl.lit(design).alias("design")))
    cells = pl.concat(rows).group_by("design", "metric", "space", "comp", "test_unit").agg(
        pl.col("m").sum(), pl.col("n_null").max(), pl.col("k").sum())
    assert cells.height == 2 * 2 * 2 * 3
    assert set(cells.filter(pl.col("test_unit") == "kv_head")["metric"]) == {"subspace"}
    for row in cells.iter_rows(named=True):
        m, n_null = expect[row["test_unit"], row["design"]]
        assert row["m"] == n_models * m and row["n_null"] == n_null, row
        a = math.floor(alpha * (n_null + 1))
        per_model = stats.betabinom(m, a, n_null + 1 - a)
        shares_kv = row["test_unit"] == "query_head" and row["comp"] in ("K", "V")
        mean, sd = n_models * per_model.mean(), math.sqrt(n_models * per_model.var() * (2.6 if shares_kv else 1.35))
        assert abs(row["k"] - mean) <= 4 * sd, (f"{row}: {row['k']} of {row['m']} tests with p <= {alpha} "
                                                f"(expected {mean:.1f} +- {sd:.1f})")


def plant_kv_circuit(w: AttentionWeights, writer: tuple[int, int], reader_kv: tuple[int, int], rank: int = 2,
                     seed: int = 0) -> None:
    """``plant_k_circuit`` into a KV head: the writer writes a ``rank``-dim subspace S that the
    keys of the reader KV head (shared by its g query heads) read only."""
    g = torch.Generator().manual_seed(seed)
    S = torch.linalg.qr(torch.randn(w.d_model, rank, generator=g, dtype=torch.float64)).Q
    (l1, h1), (l2, k2) = writer, reader_kv
    w.W_O[l1, h1] = same_norm(torch.randn(w.d_head, rank, generator=g, dtype=torch.float64) @ S.T, w.W_O[l1, h1])
    w.W_K[l2, k2] = same_norm(S @ torch.randn(rank, w.d_head, generator=g, dtype=torch.float64), w.W_K[l2, k2])


def test_a_planted_circuit_into_a_kv_head_is_one_discovery_with_g_8():
    """Llama-2-70B's grouping, g = 8 (16 query heads, 2 KV heads): a writer planted into KV head 1
    of layer 4 is, in subspace K (a KV head's test), one discovery shared by its 8 query heads, not
    8, and the only one. In frobenius and svd_bound K (W_K W_Q^T: each query head its own test) the
    query heads of that group are distinct tests with distinct scores: in residual space all 8 are
    discoveries, each counted once."""
    H, Hkv = 16, 2
    g = H // Hkv
    w = random_weights(12, L=6, H=H, Hkv=Hkv, d=64)
    # rank 4 of d_head 8: at rank 2 subspace's two angles into the planted KV head are noisier than
    # the null's eight and other writers' pairs into it become discoveries too
    plant_kv_circuit(w, writer=(1, 3), reader_kv=(4, 1), rank=4)
    group = set(range(g, 2 * g))
    for metric in NORMALISED_METRICS:  # a magnitude's planted pair: test_a_planted_circuit_has_the_largest_contribution...
        for space in ("residual", "token"):
            pq = score_and_calibrate(w, metric, space)["mirror"].filter(pl.col("comp") == "K")
            found = pq.filter(pl.col("q_value") <= 0.05)
            planted = found.filter((pl.col("writer_layer") == 1) & (pl.col("writer_head") == 3) & (pl.col("reader_layer") == 4))
            n_tests, n_planted = distinct_tests(found).height, distinct_tests(planted).height
            assert n_tests <= n_planted + 1, f"{metric}/{space}: {n_tests} discoveries, {n_planted} planted"
            if metric == "subspace":
                assert set(planted["reader_head"]) == group, (metric, space)  # every query head of the KV head
                assert (planted["test_unit"] == "kv_head").all() and planted["q_value"].n_unique() == 1
                assert n_planted == 1 and n_tests == 1, f"{metric}/{space}: {n_tests} discoveries, {n_planted} planted"
            else:
                assert (planted["test_unit"] == "query_head").all() and n_planted == planted.height
                assert set(planted["reader_head"]) <= group
                if space == "residual":
                    assert n_planted == g, f"{metric}/{space}: {n_planted} of the group's {g} query heads"


def test_the_atlas_counts_a_kv_head_finding_once(tmp_path):
    """The planted KV-head circuit (g = 8) through the atlas: composition_z and discoveries keep a
    row per query head, each saying its test's unit and the query heads that share it; the
    report's counts (calibration summary, the circuit's discoveries) count the finding once."""
    import json

    from compatlas.atlas import build_atlas, connect
    from compatlas.report import queries

    H, Hkv = 16, 2
    w = random_weights(12, L=6, H=H, Hkv=Hkv, d=64)
    w.meta.update(checkpoint="final", processing="none")
    plant_kv_circuit(w, writer=(1, 3), reader_kv=(4, 1), rank=4)
    layers = list(range(6))
    df, _ = score_block(w, "subspace", "residual", layer_pairs(layers) + null_pairs(layers, 1, 0), baseline_samples=2,
                        device="cpu", dtype="float64")
    causal = pl.col("writer_layer") < pl.col("reader_layer")
    paths = {"composition": tmp_path / "c.parquet", "calibration": tmp_path / "p.parquet"}
    write_shard(df.filter(causal), paths["composition"], {})  # sealed, as the pipeline writes them
    write_shard(calibrate(df.filter(causal), df.filter(~causal), kv_group=H // Hkv), paths["calibration"], {})
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"model": "random", "checkpoint": "final", "n_layers": 6, "n_heads": H, "n_kv_heads": Hkv}))
    build_atlas(tmp_path / "atlas.duckdb", {k: [v] for k, v in paths.items()}, [meta])
    con = connect(tmp_path / "atlas.duckdb")
    rows = con.execute("""SELECT reader_head, test_unit, reader_kv_head, test_reader_heads FROM discoveries
                      WHERE comp = 'K' ORDER BY reader_head""").fetchall()
    assert [r[0] for r in rows] == list(range(8, 16))
    assert all(r[1:] == ("kv_head", 1, list(range(8, 16))) for r in rows)
    assert con.execute("SELECT count(*) FROM discoveries WHERE comp = 'K' AND reader_head = test_reader_heads[1]").fetchone() == (1,)
    q_row = con.execute("SELECT test_unit, test_reader_heads FROM composition_z WHERE comp = 'Q' LIMIT 1").fetchone()
    assert q_row[0] == "query_head" and len(q_row[1]) == 1
    summary = queries.calibration_summary(con, "random", "final", 0.05)
    assert summary.filter(pl.col("comp") == "K")["discoveries"].to_list() == [1]
    assert queries.discoveries(con, "random", "final", 0.05).filter(pl.col("comp") == "K")["n_total"].max() == 1


def test_invalid_settings_are_refused_in_one_line():
    w = random_weights(1, L=3, H=2, Hkv=2)
    df, _ = score_block(w, "frobenius", "residual", layer_pairs([0, 1, 2]) + null_pairs([0, 1, 2], 1, 0),
                        baseline_samples=2, device="cpu", dtype="float64")
    causal, null = df.filter(pl.col("writer_layer") < pl.col("reader_layer")), df.filter(pl.col("writer_layer") >= pl.col("reader_layer"))
    for kwargs, message in (({"stratify": "layer"}, "stratify 'layer': choose one of"),
                            ({"null_pairs": "all"}, "null_pairs 'all': choose one of"),
                            ({"kv_group": 0}, "kv_group 0: query heads per KV head is at least 1")):
        with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")) as e:
            calibrate(causal, null, **{"kv_group": 1, **kwargs})
        assert "\n" not in str(e.value)


def test_null_shards_without_causal_shards_are_refused(tmp_path):
    """A null shard whose metric x space folder has no causal shard (a partial copy, a deleted
    causal shard) is an error naming that folder, not a calibration on nothing."""
    w = random_weights(2, L=3, H=2, Hkv=2)
    df, _ = score_block(w, "subspace", "token", null_pairs([0, 1, 2], 1, 0), baseline_samples=2, device="cpu",
                        dtype="float64")
    path = tmp_path / "null" / "metric=subspace" / "space=token" / "block=0.parquet"
    path.parent.mkdir(parents=True)
    df.write_parquet(path)
    with pytest.raises(ValueError, match=r"^null shards of metric=subspace/space=token have no causal shards beside them$"):
        list(calibrate_shards([], [str(path)], kv_group=1))
