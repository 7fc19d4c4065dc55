"""The heatmap of a model with too many heads for a cell per head pair: a layer x layer map,
each cell the strongest head pair of its writer layer and reader layer (``queries.heatmap_blocks``,
aggregated in DuckDB), so the page carries layers^2 cells whatever the number of heads.

A 70B model (80 layers x 64 heads) has 13M causal head pairs per comp: a cell per pair would be
tens of millions of marks and hundreds of MB of page. Its discoveries and strongest pairs are
drawn and listed in full by the circuit view and the findings tables; this map says where in
depth they sit."""

from __future__ import annotations

import altair as alt
import numpy as np
import polars as pl

from compatlas.report.heatmaps import DISCOVERY_MARK, METRIC_TEXT, SPACE_TEXT
from compatlas.report.page import order

# above this many causal head pairs per comp the page gets the layer x layer map: a cell per
# pair stays below about 3 MB of page up to here (24 layers x 16 heads: 70k pairs)
PAIR_CELLS_MAX = 100_000
BLOCK_DATA = "blocks"  # name of the map's dataset in the spec's top-level "datasets" (``block_rows``)


def causal_pairs(n_layers: int, n_heads: int) -> int:
    """Causal head pairs per comp (writer layer < reader layer)."""
    return n_layers * (n_layers - 1) // 2 * n_heads * n_heads


def use_blocks(n_layers: int, n_heads: int) -> bool:
    return causal_pairs(n_layers, n_heads) > PAIR_CELLS_MAX


def block_rows(blocks: pl.DataFrame) -> list[dict]:
    """The map's data: one compact row per comp x writer layer x reader layer."""
    d = blocks.with_columns(
        z=(pl.col("score") - pl.col("baseline_spectrum_mean")) / pl.col("baseline_spectrum_std"),
        lp=-pl.col("p_value").cast(pl.Float64).clip(1e-300).log10(),
        q=pl.col("q_value"), p=pl.col("p_value"),
    )
    out = []
    for r in d.iter_rows(named=True):
        out.append({"c": r["comp"], "wl": r["writer_layer"], "rl": r["reader_layer"], "wh": r["writer_head"],
                    "rh": r["reader_head"], "s": _round(r["score"], 4), "m": _round(r["baseline_spectrum_mean"], 4),
                    "z": _round(r["z"], 2), "lp": _round(r["lp"], 2), "p": _sig(r["p"]), "q": _sig(r["q"]),
                    "n": r["pairs"], "d": r["discoveries"]})
    return out


def _round(x, k: int):
    return None if x is None or not np.isfinite(x) else round(float(x), k)


def _sig(x):
    return None if x is None or not np.isfinite(x) else float(f"{x:.3g}")


def block_chart(blocks: pl.DataFrame, model: str, checkpoint: str, metric: str, space: str, n_layers: int,
                n_heads: int, q_cut: float | None) -> alt.Chart:
    """Writer layer x reader layer, the comp chosen by radio buttons; colour: the block's
    discoveries (without calibration: the z of its highest-scoring pair); cyan outline: a block
    with discoveries; the tooltip names the block's strongest pair. The chart reads the named
    dataset BLOCK_DATA (``block_rows``: layers^2 rows per comp)."""
    calibrated = blocks["p_value"].is_not_null().any()
    comps = order(blocks["comp"].unique().to_list(), ("K", "Q", "V"))
    pick = alt.param(name="comp", value=comps[0], bind=alt.binding_radio(options=comps, name="composition: "))
    side = max(360, min(720, 9 * n_layers))
    if calibrated:  # the best p of thousands of pairs is small by chance alone: colour by discoveries
        colour = alt.Color("d:Q", title=["discoveries", "in the block"],
                           scale=alt.Scale(scheme="inferno", reverse=True, type="sqrt", domainMin=0))
        what = ("Colour: the block's discoveries (pairs whose p against this model's own non-causal pairs passes "
                f"q <= {q_cut:g})" if q_cut is not None else "Colour: the block's discoveries")
    else:
        colour = alt.Color("z:Q", title="z (spectrum-kept null)", scale=alt.Scale(scheme="inferno", reverse=True))
        what = "Colour: z of the block's highest-scoring pair against its spectrum-kept null (no calibration in this atlas)"
    data = alt.Data(name=BLOCK_DATA)
    base = (alt.Chart(data).transform_filter("datum.c == comp")
            .transform_calculate(wl1="datum.wl + 1", rl1="datum.rl + 1",
                                 writer="'L' + datum.wl + '.H' + datum.wh", reader="'L' + datum.rl + '.H' + datum.rh"))
    tooltip = [alt.Tooltip("writer:N", title="strongest pair: writer"), alt.Tooltip("reader:N", title="reader"),
               alt.Tooltip("c:N", title="comp"), alt.Tooltip("s:Q", title="score", format=".3f"),
               alt.Tooltip("m:Q", title="spectrum-kept null mean", format=".3f"), alt.Tooltip("z:Q", format=".1f"),
               alt.Tooltip("p:Q", format=".2e"), alt.Tooltip("q:Q", format=".2e"),
               alt.Tooltip("d:Q", title="discoveries in the block", format=","),
               alt.Tooltip("n:Q", title="head pairs in the block", format=",")]
    rect = base.mark_rect(strokeWidth=0).encode(
        x=alt.X("rl:Q", title="reader layer", scale=alt.Scale(domain=[0, n_layers], nice=False, zero=True)), x2="rl1:Q",
        y=alt.Y("wl:Q", title="writer layer", scale=alt.Scale(domain=[0, n_layers], nice=False, zero=True, reverse=True)),
        y2="wl1:Q", color=colour, tooltip=tooltip)
    layers = [rect]
    if calibrated and q_cut is not None and side / n_layers >= 12:  # smaller cells: the colour alone says it
        layers.append(base.transform_filter("datum.d > 0").transform_calculate(rc="datum.rl + 0.5", wc="datum.wl + 0.5")
                      .mark_point(shape="square", filled=False, color=DISCOVERY_MARK, strokeWidth=1,
                                  size=max(16.0, (side / n_layers) ** 2 * 0.8))
                      .encode(x="rc:Q", y="wc:Q", tooltip=tooltip))
        what += "; cyan squares: blocks with any"
    title = alt.TitleParams(
        f"{model} @ {checkpoint}: {metric}, {space} space, by layer pair",
        subtitle=[f"score = {METRIC_TEXT.get(metric, metric)}; space: {SPACE_TEXT.get(space, space)}.",
                  f"Each cell: the strongest of the {n_heads} x {n_heads} head pairs of a writer layer (row) and a "
                  "later reader layer (column). " + what + ".",
                  "Pick Q, K or V below; hover a cell for its strongest pair and the block's discoveries."],
        anchor="start", fontSize=14, subtitleFontSize=11, subtitleColor="#444")
    return (alt.layer(*layers).add_params(pick).properties(width=side, height=side, title=title)
            .configure_view(stroke="#999", fill="#f4f4f4"))
