"""The circuit view: a model's discoveries as a layered node-link graph (heads placed by layer
and head, one curved edge per discovery, one panel per comp, weighted by score), one metric x
space at a time through a dropdown."""

from __future__ import annotations

import altair as alt
import numpy as np
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


CURVE_POINTS = 9  # points along each edge's curve


def curves(e: pl.DataFrame) -> pl.DataFrame:
    """Each edge as a quadratic Bezier from writer (head, layer) to reader, bowed sideways by
    about half a head at its middle: an edge no longer runs straight through the heads of the
    layers between its ends, and edges between the same heads in different comps or layers part.
    Rows: the edge's columns plus ``eid``, ``t`` (0..1 along it), ``x`` (head) and ``y`` (layer)."""
    if e.is_empty():
        return e.with_columns(eid=pl.lit(0), t=pl.lit(0.0), x=pl.lit(0.0), y=pl.lit(0.0)).clear()
    e = e.with_row_index("eid")
    x0, x1 = e["writer_head"].cast(pl.Float64).to_numpy(), e["reader_head"].cast(pl.Float64).to_numpy()
    y0, y1 = e["writer_layer"].cast(pl.Float64).to_numpy(), e["reader_layer"].cast(pl.Float64).to_numpy()
    # bow outwards from the writer's column; straight-down edges alternate sides by layer
    side = np.where(x1 > x0, 1.0, np.where(x1 < x0, -1.0, np.where(y0 % 2 == 0, 1.0, -1.0)))
    cx, cy = (x0 + x1) / 2 + side * 1.0, (y0 + y1) / 2
    t = np.linspace(0.0, 1.0, CURVE_POINTS)
    a, b, c = ((1 - t) ** 2)[None], (2 * (1 - t) * t)[None], (t ** 2)[None]
    xs = a * x0[:, None] + b * cx[:, None] + c * x1[:, None]
    ys = a * y0[:, None] + b * cy[:, None] + c * y1[:, None]
    pts = pl.DataFrame({"eid": np.repeat(e["eid"].to_numpy(), CURVE_POINTS), "t": np.tile(t, e.height),
                        "x": xs.ravel(), "y": ys.ravel()})
    return pts.join(e, on="eid", how="left")


def circuit_chart(edges: pl.DataFrame, nodes: pl.DataFrame, model: str, checkpoint: str, lead: tuple[str, str],
                  q_cut: float | None, candidates: bool = False,
                  combos_scored: list[tuple[str, str]] | None = None) -> alt.HConcatChart:
    """One panel per comp (Q, K, V side by side, so their edges never lie on top of each other),
    each edge a curve (``curves``). ``edges``: queries.discoveries of the model x checkpoint (any
    metric x space), or with ``candidates`` queries.strongest (there are no discoveries): drawn
    dashed, said so. The dropdown lists every metric x space scored (``combos_scored``) with its
    number of discoveries, none left out for having none."""
    n_layers, n_heads = int(nodes["layer"].max()) + 1, int(nodes["head"].max()) + 1
    e = edges.with_columns(combo=pl.col("metric") + " · " + pl.col("space"),
                           writer="L" + pl.col("writer_layer").cast(pl.Utf8) + ".H" + pl.col("writer_head").cast(pl.Utf8),
                           reader="L" + pl.col("reader_layer").cast(pl.Utf8) + ".H" + pl.col("reader_head").cast(pl.Utf8))
    scored = [f"{m} · {s}" for m, s in (combos_scored or [])] or sorted(set(e["combo"]))
    combos = [f"{m} · {s}" for m in METRICS for s in SPACES if f"{m} · {s}" in scored] + sorted(
        set(scored) - {f"{m} · {s}" for m in METRICS for s in SPACES})
    counts = {r["combo"]: int(r["n"]) for r in e.group_by("combo").agg(pl.col("n_total").max().alias("n")).iter_rows(named=True)}
    default = f"{lead[0]} · {lead[1]}"
    labels = [f"{c} ({'no discoveries' if not counts.get(c) or candidates else f'{counts[c]:,} discoveries'})"
              for c in combos]
    pick = alt.param(name="combo", value=default if default in combos else (combos[0] if combos else default),
                     bind=alt.binding_select(options=combos or [default], labels=labels or None, name="metric · space: "))
    comps = order(e["comp"].unique().to_list(), COMPS) or list(COMPS)
    panel_w = max(160, min(46 * n_heads + 40, (CONTENT - 330) // len(comps)))  # room for axes and legends
    height = min(900, max(200, 30 * n_layers))
    xs = alt.Scale(domain=[-1, n_heads], nice=False)
    ys = alt.Scale(domain=[n_layers - 0.5, -0.5], nice=False)
    x = alt.X("head:Q", scale=xs, axis=alt.Axis(title="head", values=list(range(n_heads)), format="d", grid=False))
    y = alt.Y("layer:Q", scale=ys, axis=alt.Axis(title="layer", values=list(range(n_layers)), format="d", grid=True,
                                                 gridOpacity=0.3, labelOverlap=True))
    roles = [PREV, IND, OTHER]
    points = alt.Chart(nodes).mark_circle(stroke="#333", strokeWidth=0.5, opacity=1).encode(
        x=x, y=y, size=alt.value(max(20, min(140, 6000 // max(n_heads * n_layers, 1) + 20))),
        color=alt.Color("role:N", scale=alt.Scale(domain=roles, range=["#f58518", "#b279a2", "#e8e8e8"]),
                        legend=alt.Legend(title="head (behaviour)", orient="right")),
        tooltip=[alt.Tooltip("layer:Q"), alt.Tooltip("head:Q"), "role:N",
                 alt.Tooltip("prev_token:Q", title="previous-token score", format=".2f"),
                 alt.Tooltip("induction:Q", title="induction score", format=".2f")])
    pts = curves(e)
    smax = float(e["score"].max()) if e.height else 1.0
    smin = float(e["score"].min()) if e.height else 0.0
    panels = []
    for comp in comps:
        link = alt.Chart(pts.filter(pl.col("comp") == comp)).transform_filter("datum.combo == combo").mark_line(
            strokeCap="round", interpolate="linear", color=COMP_COLOURS.get(comp, "#888"), opacity=0.75,
            strokeDash=[4, 3] if candidates else [1, 0]).encode(
            x=alt.X("x:Q", scale=xs), y=alt.Y("y:Q", scale=ys), detail="eid:N", order="t:Q",
            strokeWidth=alt.StrokeWidth("score:Q", scale=alt.Scale(domain=[smin, max(smax, smin + 1e-9)], range=[0.8, 4.5]),
                                        legend=alt.Legend(title="score", format=".3f")),  # the same in every panel: one legend
            tooltip=[alt.Tooltip("writer:N"), alt.Tooltip("reader:N"), "comp:N", alt.Tooltip("score:Q", format=".3f"),
                     alt.Tooltip("baseline_spectrum_mean:Q", title="spectrum-kept null mean", format=".3f"),
                     alt.Tooltip("z_spectrum:Q", title="z", format=".1f"),
                     alt.Tooltip("n_null:Q", title="non-causal null pairs", format=","),
                     alt.Tooltip("p_value:Q", title="p", format=".2e"), alt.Tooltip("q_value:Q", title="q", format=".2e")])
        panels.append(alt.layer(link, points).properties(width=panel_w, height=height, title=alt.TitleParams(
            f"{comp}-composition", color=COMP_COLOURS.get(comp, "#333"), fontSize=13, anchor="middle")))
    cap = int(e["n_total"].max()) if e.height else 0
    fdr = q_cut if q_cut is not None else "fdr"
    return alt.hconcat(*panels, spacing=12).add_params(pick).properties(title=alt.TitleParams(
        f"{model} @ {checkpoint}: the circuit its weights show", anchor="start", fontSize=14, subtitleColor="#444",
        subtitle=([f"No pair is a discovery (q <= {fdr}): dashed curves are the pairs with the smallest p per metric · "
                   "space, NOT a circuit."] if candidates else
                  [f"Curves: the discoveries (q <= {fdr}), writer head (upper) to reader head in a later layer, one panel "
                   "per comp, thicker for a higher score" + (f"; of the {cap:,} discoveries, the {EDGE_MAX} with the "
                                                            "smallest q" if cap > EDGE_MAX else "") + "."])
        + ["Nodes: every head, coloured by what it does on repeated random tokens (head scores). The menu lists "
           "every metric · space with its number of discoveries."]))
