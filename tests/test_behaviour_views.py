"""The DuckDB views that put composition beside behaviour, checked against independent
computations: scipy's Spearman, AUROC by counting pairs, summaries by hand."""

from __future__ import annotations

import itertools
import math

import numpy as np
import polars as pl
import pytest
from scipy.stats import spearmanr

from compatlas.atlas import MIN_CLASS, MIN_READERS, build_atlas, connect
from compatlas.storage import write_shard
from compatlas.tables import COMPOSITION_SCHEMA, HEAD_SCORES_SCHEMA, INDUCTION_TOKENS_SCHEMA
from compatlas.vocab import COMPS

L, H = 4, 4  # 12 readers: enough for Spearman (atlas.MIN_READERS)


def _heads(rng, model: str = "m", L: int = L, H: int = H) -> pl.DataFrame:
    rows = []
    for layer, head in itertools.product(range(L), range(H)):
        rows.append({"model": model, "checkpoint": "final", "layer": layer, "head": head,
                     "prev_token_mean": float(rng.uniform(0, 0.3)), "prev_token_std": 0.1,
                     "duplicate_mean": 0.0, "duplicate_std": 0.0,
                     "induction_mean": float(np.round(rng.uniform(0, 1), 1)),  # ties on purpose
                     "induction_std": 0.1, "n_sequences": 8, "ablation": "zero",
                     "ablation_drop": float(rng.normal()), "ablation_drop_stderr": 0.1, "clean_strength": 1.0})
    rows[1]["prev_token_mean"] = 0.9  # head 0.1 and 1.2 are previous-token heads
    rows[H + 2]["prev_token_mean"] = 0.5
    return pl.DataFrame(rows, schema=HEAD_SCORES_SCHEMA)


def _composition(rng, model: str = "m", L: int = L, H: int = H) -> pl.DataFrame:
    rows = []
    for (l1, h1), (l2, h2) in itertools.product(itertools.product(range(L), range(H)), repeat=2):
        if l1 < l2:
            for comp in COMPS:
                rows.append({"model": model, "checkpoint": "final", "processing": "none", "space": "residual",
                             "metric": "frobenius", "comp": comp, "writer_layer": l1, "writer_head": h1,
                             "reader_layer": l2, "reader_head": h2, "score": float(rng.uniform()),
                             "baseline_gaussian_mean": 0.1, "baseline_gaussian_std": 0.01,
                             "baseline_spectrum_mean": 0.2, "baseline_spectrum_std": 0.05})
    return pl.DataFrame(rows, schema=COMPOSITION_SCHEMA)


@pytest.fixture(scope="module")
def atlas(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("views")
    rng = np.random.default_rng(0)
    heads, comp = _heads(rng), _composition(rng)
    # a model too small for the statistics: 2 layers x 3 heads, 3 readers
    small_heads, small_comp = _heads(rng, "small", 2, 3), _composition(rng, "small", 2, 3)
    toks = pl.DataFrame([{"model": "m", "checkpoint": "final", "filler_before": 10, "filler_between": 10,
                          "token_id": t, "token_text": f"t{t}", "role": r, "n": 4, "mean": float(t + (r == "B")),
                          "std": 1.0, "stderr": 0.5, "near_b_id": None, "near_b_mean": 0.5, "near_b_stderr": 0.2,
                          "random_mean": 0.0, "random_stderr": 0.1} for t in range(3) for r in ("A", "B")],
                        schema=INDUCTION_TOKENS_SCHEMA)
    paths = {}
    for name, df in (("composition", comp), ("head_scores", heads), ("induction_tokens", toks)):
        paths[name] = [tmp / f"{name}.parquet"]
        write_shard(df, paths[name][0], {"test": True})
    for name, df in (("composition", small_comp), ("head_scores", small_heads)):
        paths[name].append(tmp / f"{name}_small.parquet")
        write_shard(df, paths[name][-1], {"test": True})
    build_atlas(tmp / "atlas.duckdb", paths, [], prev_token_threshold=0.4, induction_threshold=0.5)
    return connect(tmp / "atlas.duckdb"), heads, comp


def test_reader_best_composition_takes_the_max_over_prev_token_heads(atlas):
    con, _, comp = atlas
    prev = {(0, 1), (1, 2)}
    got = con.sql("SELECT layer, head, best_score FROM reader_best_composition WHERE comp = 'K' AND model = 'm'").pl()
    expect = {}
    for r in comp.filter(pl.col("comp") == "K").iter_rows(named=True):
        if (r["writer_layer"], r["writer_head"]) in prev:
            key = (r["reader_layer"], r["reader_head"])
            expect[key] = max(expect.get(key, -1), r["score"])
    assert {(r["layer"], r["head"]): r["best_score"] for r in got.iter_rows(named=True)} == pytest.approx(expect)
    assert len(expect) == (L - 1) * H  # readers of layer 1 see 0.1; of layers 2, 3 see both


def test_spearman_and_auroc_match_independent_computations(atlas):
    con, _, _ = atlas
    best = con.sql("SELECT * FROM reader_best_composition WHERE comp = 'Q' AND model = 'm' ORDER BY layer, head").pl()
    out = con.sql("SELECT * FROM composition_vs_behaviour WHERE comp = 'Q' AND model = 'm'").pl().row(0, named=True)
    score, ind, abl = best["best_score"].to_numpy(), best["induction_mean"].to_numpy(), best["ablation_drop"].to_numpy()
    assert out["spearman_induction"] == pytest.approx(spearmanr(score, ind).statistic, abs=1e-12)
    assert out["spearman_ablation"] == pytest.approx(spearmanr(score, abl).statistic, abs=1e-12)
    pos, neg = score[ind >= 0.5], score[ind < 0.5]
    pairs = [(p > n) + 0.5 * (p == n) for p in pos for n in neg]
    assert out["auroc"] == pytest.approx(sum(pairs) / len(pairs), abs=1e-12)
    assert out["n_readers"] == len(best) and out["n_induction_heads"] == len(pos)
    assert len(best) >= MIN_READERS and min(len(pos), len(neg)) >= MIN_CLASS  # so the values above are given


def test_no_statistic_below_its_minimum_count(atlas):
    """3 readers: Spearman would be +-1 or so from noise, AUROC from one or two heads; the view
    gives NULL, with the counts beside it, and the report shows what the view gives."""
    con, _, _ = atlas
    rows = con.sql("SELECT * FROM composition_vs_behaviour WHERE model = 'small'").pl()
    assert rows.height == len(COMPS)
    assert rows["n_readers"].to_list() == [3] * len(COMPS)
    assert rows["spearman_induction"].is_null().all() and rows["spearman_ablation"].is_null().all()
    assert rows["auroc"].is_null().all()


def test_induction_summary_by_hand(atlas):
    con, _, _ = atlas
    a = con.sql("SELECT * FROM induction_summary WHERE role = 'A'").pl().row(0, named=True)
    assert a["n_tokens"] == 3 and a["n_sequences"] == 12
    assert a["mean_strength"] == pytest.approx(1.0)  # tokens' A powers 0, 1, 2
    assert a["power_spread"] == pytest.approx(1.0)
    assert a["mean_stderr"] == pytest.approx(math.sqrt(3 * 0.25) / 3)
    assert a["near_b_mean"] == pytest.approx(0.5) and a["random_mean"] == pytest.approx(0.0)
