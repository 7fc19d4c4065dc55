"""The report of a model with many heads hands its page aggregated data: a layer x layer map
whose cells are the strongest pair of each block, computed in DuckDB, never a cell per head pair.

The model (10 layers x 48 heads: 103,680 causal pairs per comp) is just above the threshold
(``blocks.PAIR_CELLS_MAX``); the expected blocks are recomputed here with polars from the shards."""

from __future__ import annotations

import json
import re

import polars as pl
from synthetic_atlas import Spec, write_suite

from compatlas.report import blocks, build_report


def _specs(page: str) -> list[dict]:
    return [json.loads(m) for m in re.findall(r'<script type="application/json" id="spec\d+">(.*?)</script>', page, re.S)]


def test_a_model_with_many_heads_gets_layer_blocks(tmp_path):
    L, H = 10, 48
    assert blocks.use_blocks(L, H) and not blocks.use_blocks(L, 32)
    db = write_suite(tmp_path, [Spec("wide", L, H)], metrics=("frobenius",), spaces=("residual",))
    written = build_report(db, tmp_path / "report", png=False)
    page = (tmp_path / "report" / "model-wide.html").read_text(encoding="utf-8")
    assert "Every layer pair" in page and "Every head pair" not in page
    assert f"{blocks.causal_pairs(L, H):,} causal head pairs per comp" in page
    maps = [s for s in _specs(page) if "by layer pair" in json.dumps(s)]
    assert len(maps) == 1
    (data,) = maps[0]["datasets"].values()  # the map's one dataset, inline
    n_blocks = L * (L - 1) // 2
    assert len(data) == 3 * n_blocks  # a cell per comp x layer pair, not per head pair (3 x 103,680)

    # each block's strongest pair: smallest p, then largest score; its discoveries, from the shards
    comp = pl.read_parquet(tmp_path / "composition" / "*.parquet")
    cal = pl.read_parquet(tmp_path / "calibration" / "*.parquet")
    keys = ["comp", "writer_layer", "writer_head", "reader_layer", "reader_head"]
    j = comp.join(cal, on=keys)
    expect = (j.sort(["p_value", "score"], descending=[False, True])
              .group_by(["comp", "writer_layer", "reader_layer"], maintain_order=True)
              .agg(pl.col("writer_head").first(), pl.col("reader_head").first(), pl.col("score").first(),
                   (pl.col("q_value") <= 0.05).sum().alias("d"), pl.len().alias("n")))
    got = pl.DataFrame(data).select(comp="c", writer_layer="wl", reader_layer="rl", wh="wh", rh="rh", s="s", d="d", n="n")
    both = expect.join(got, on=["comp", "writer_layer", "reader_layer"], how="full", coalesce=True)
    assert both.height == 3 * n_blocks and both["wh"].null_count() == 0 and both["writer_head"].null_count() == 0
    assert (both["wh"] == both["writer_head"]).all() and (both["rh"] == both["reader_head"]).all()
    assert ((both["s"] - both["score"]).abs() < 1e-4).all()
    assert (both["d"] == both["d_right"]).all() and (both["n"] == H * H).all() and (both["n_right"] == H * H).all()
    assert both["d"].sum() > 0  # the planted K discoveries are in it
    assert len(page.encode()) < 3_000_000
    assert {p.name for p in written} >= {"index.html", "model-wide.html"}
