"""The circuit view: a model's discoveries as a layered node-link graph (heads placed by layer
and head, one edge per discovery coloured by comp and weighted by score), one metric x space
at a time through a dropdown."""

from __future__ import annotations

import altair as alt
import polars as pl

from compatlas.report.queries import EDGE_MAX
from compatlas.report.page import COMP_COLOURS, CONTENT, order
from compatlas.vocab import COMPS, METRICS, SPACES

PREV, IND, OTHER = "previous-token head", "induction head", "other head"


def node_frame(n_layers: int, n_heads: int, heads: pl.DataFrame, prev_cut: float, ind_cut: float) -> pl.DataFrame:
    """Every head with its role from the head scores (when there are any)."""
    nodes = pl.DataFrame({"layer": [l for l in range(n_layers) for _ in range(n_heads)],
                          "head": [h for _ in range(n_layers) for h in range(n_heads)]})
    if heads.is_empty():
        return nodes.with_columns(role=pl.lit(OTHER), prev_token=pl.lit(None, pl.Float64),
                                  induction=pl.lit(None, pl.Float64))
    hs = heads.select("layer", "head", pl.col("prev_token_mean").alias("prev_token"),
                      pl.col("induction_mean").alias("induction")).cast({"layer": pl.Int64, "head": pl.Int64})
    nodes = nodes.join(hs, on=["layer", "head"], how="left")
    return nodes.with_columns(role=pl.when(pl.col("induction") >= ind_cut).then(pl.lit(IND))
                              .when(pl.col("prev_token") >= prev_cut).then(pl.lit(PREV)).otherwise(pl.lit(OTHER)))


def circuit_chart(edges: pl.DataFrame, nodes: pl.DataFrame, model: str, checkpoint: str, lead: tuple[str, str],
                  q_cut: float | None, candidates: bool = False) -> alt.LayerChart:
    """``edges``: queries.discoveries of the model x checkpoint (any metric x space), or with
    ``candidates`` queries.strongest (there are no discoveries): drawn dashed, said so."""
    n_layers, n_heads = int(nodes["layer"].max()) + 1, int(nodes["head"].max()) + 1
    width = min(CONTENT - 260, max(260, 46 * n_heads))
    height = min(900, max(200, 30 * n_layers))
    e = edges.with_columns(combo=pl.col("metric") + " · " + pl.col("space"),
                           writer="L" + pl.col("writer_layer").cast(pl.Utf8) + ".H" + pl.col("writer_head").cast(pl.Utf8),
                           reader="L" + pl.col("reader_layer").cast(pl.Utf8) + ".H" + pl.col("reader_head").cast(pl.Utf8))
    combos = [f"{m} · {s}" for m in METRICS for s in SPACES
              if f"{m} · {s}" in set(e["combo"])] + sorted(set(e["combo"]) - {f"{m} · {s}" for m in METRICS for s in SPACES})
    default = f"{lead[0]} · {lead[1]}"
    pick = alt.param(name="combo", value=default if default in combos else (combos[0] if combos else default),
                     bind=alt.binding_select(options=combos or [default], name="metric · space: "))
    comp_sel = alt.selection_point(fields=["comp"], bind="legend")
    xs = alt.Scale(domain=[-0.5, n_heads - 0.5], nice=False)
    ys = alt.Scale(domain=[n_layers - 0.5, -0.5], nice=False)
    x = alt.X("head:Q", scale=xs,
              axis=alt.Axis(title="head", values=list(range(n_heads)), format="d", grid=False))
    y = alt.Y("layer:Q", scale=ys,
              axis=alt.Axis(title="layer", values=list(range(n_layers)), format="d", grid=True, gridOpacity=0.3,
                                   labelOverlap=True))
    comps = order(e["comp"].unique().to_list(), COMPS) or list(COMPS)
    links = alt.Chart(e).add_params(pick, comp_sel).transform_filter("datum.combo == combo").mark_rule(
        strokeCap="round", strokeDash=[4, 3] if candidates else [1, 0]).encode(
        x=alt.X("writer_head:Q", scale=xs), y=alt.Y("writer_layer:Q", scale=ys),
        x2="reader_head:Q", y2="reader_layer:Q",
        color=alt.Color("comp:N", scale=alt.Scale(domain=comps, range=[COMP_COLOURS.get(c, "#888") for c in comps]),
                        legend=alt.Legend(title="comp (click to pick)", orient="right")),
        strokeWidth=alt.StrokeWidth("score:Q", scale=alt.Scale(range=[0.6, 4.5]), legend=alt.Legend(title="score", format=".3f")),
        opacity=alt.condition(comp_sel, alt.value(0.7), alt.value(0.04)),
        tooltip=[alt.Tooltip("writer:N"), alt.Tooltip("reader:N"), "comp:N", alt.Tooltip("score:Q", format=".3f"),
                 alt.Tooltip("baseline_spectrum_mean:Q", title="spectrum-kept null mean", format=".3f"),
                 alt.Tooltip("z_spectrum:Q", title="z", format=".1f"),
                 alt.Tooltip("n_null:Q", title="non-causal null pairs", format=","),
                 alt.Tooltip("p_value:Q", title="p", format=".2e"), alt.Tooltip("q_value:Q", title="q", format=".2e"),
                 alt.Tooltip("n_total:Q", title="discoveries in this metric · space", format=",")])
    roles = [PREV, IND, OTHER]
    points = alt.Chart(nodes).mark_circle(stroke="#333", strokeWidth=0.5).encode(
        x=x, y=y, size=alt.value(max(20, min(140, 6000 // max(n_heads * n_layers, 1) + 20))),
        color=alt.Color("role:N", scale=alt.Scale(domain=roles, range=["#f58518", "#b279a2", "#e8e8e8"]),
                        legend=alt.Legend(title="head (behaviour)", orient="right")),
        tooltip=[alt.Tooltip("layer:Q"), alt.Tooltip("head:Q"), "role:N",
                 alt.Tooltip("prev_token:Q", title="previous-token score", format=".2f"),
                 alt.Tooltip("induction:Q", title="induction score", format=".2f")])
    cap = int(e["n_total"].max()) if e.height else 0
    return alt.layer(links, points).resolve_scale(color="independent").properties(
        width=width, height=height, title=alt.TitleParams(
            f"{model} @ {checkpoint}: the circuit its weights show", anchor="start", fontSize=14, subtitleColor="#444",
            subtitle=([f"No pair is a discovery (q <= {q_cut if q_cut is not None else 'fdr'}): dashed edges are the pairs with "
                       "the smallest p per metric · space, NOT a circuit."] if candidates else
                      [f"Edges: the discoveries (q <= {q_cut if q_cut is not None else 'fdr'}) from a writer head to a reader "
                       "head in a later layer, coloured by comp, thicker for a higher score"
                       + (f"; of the {cap:,} discoveries, the {EDGE_MAX} with the smallest q" if cap > EDGE_MAX else "")
                       + "."]) + [
                      "Nodes: every head, coloured by what it does on repeated random tokens (head scores)."]))
