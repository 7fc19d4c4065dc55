"""The trained model's circuit edge over training (docs/report.md): the edge exact patching ranks
first at the last checkpoint (``circuit_edge``), its exact patching and every attribution method
with their standard errors on one step axis, and its K-composition in the metric x space that
follows its function most closely over the checkpoints (``follow_cell``)."""

from __future__ import annotations

import html
from typing import Any

import altair as alt
import duckdb
import numpy as np
import polars as pl

from compatlas.function.comp_agreement import cell_order
from compatlas.report import queries as q
from compatlas.report.page import Page, fmt, head, note, order
from compatlas.report.training import log_axis, step_x
from compatlas.tables import number
from compatlas.vocab import EDGE_METHODS

EXACT = "exact patching"


def circuit_edge(con: duckdb.DuckDBPyConnection, d: Any) -> tuple[tuple[int, int], tuple[int, int], str] | None:
    """The edge the over-training chart follows, and the rule that chose it: the K edge exact
    patching ranks first at the last checkpoint (largest |exact patching|); without exact
    patching there, the eventual previous-token head into the eventual induction head (head scores)."""
    top = q.top_exact_edge(con, d.model, d.latest, "K")
    if top is not None:
        return (*top, f"the K edge exact patching ranks first at the last checkpoint ({html.escape(d.latest)}: "
                      "the largest |exact patching|)")
    if d.outcome is None or d.outcome.pair is None:
        return None
    (il, ih), (pl_, ph) = d.outcome.pair
    return (pl_, ph), (il, ih), ("the eventual previous-token head into the eventual induction head (head scores; "
                                 "this atlas has no exact patching at the last checkpoint)")


def follow_cell(curves: pl.DataFrame, exact: pl.DataFrame) -> tuple[tuple[str, str], float, int] | None:
    """The metric x space whose K-composition of the edge follows its |exact patching| most closely
    over the checkpoints (Spearman over the steps with both, at least 3; ties to the usual order):
    (cell, Spearman, checkpoints). ``curves``: metric, space, comp, step, score; ``exact``: step, exact."""
    if curves.is_empty() or exact.is_empty():
        return None
    k = curves.filter(pl.col("comp") == "K").join(exact.select("step", fn=pl.col("exact").abs()), on="step")
    best: tuple[tuple[str, str], float, int] | None = None
    for cell in cell_order([tuple(r) for r in k.select("metric", "space").unique().iter_rows()]):
        g = k.filter((pl.col("metric") == cell[0]) & (pl.col("space") == cell[1]))
        if g.height < 3 or g["score"].n_unique() < 2 or g["fn"].n_unique() < 2:
            continue
        rho = float(g.select(pl.corr("score", "fn", method="spearman")).item())
        if np.isfinite(rho) and (best is None or rho > best[1]):
            best = (cell, rho, g.height)
    return best


def training_chart(fn: pl.DataFrame, comp_curve: pl.DataFrame, edge: str, rule: str, follow: str) -> alt.VConcatChart:
    """The edge's exact patching and every attribution method (each +-1 standard error) on one
    panel, its K-composition below, over one step axis. ``fn``: step, series, value, stderr."""
    top = max(number(fn["step"].max()), number(comp_curve["step"].max()) if comp_curve.height else 0.0)
    log = log_axis(pl.concat([fn["step"], comp_curve["step"]]) if comp_curve.height else fn["step"])
    f = fn.with_columns(lo=pl.col("value") - pl.col("stderr"), hi=pl.col("value") + pl.col("stderr")).cast({"step": pl.Float64})
    series = order(f["series"].unique(), (EXACT, *EDGE_METHODS))
    palette = {EXACT: "#222222", "eap": "#e45756", "eap_attn": "#f58518", "eap_ig": "#b279a2"}
    colour = alt.Color("series:N", title=None, sort=series,
                       scale=alt.Scale(domain=series, range=[palette.get(s, "#888") for s in series]),
                       legend=alt.Legend(orient="top", labelLimit=240))
    y_title = ["change in log-prob", "of the induced tokens"]  # on both layers: a layer without it drops the shared title
    bars = alt.Chart(f).mark_errorbar(ticks=True).encode(x=step_x(top, log, None), y=alt.Y("lo:Q", title=y_title), y2="hi:Q",
                                                          color=colour)
    lines = alt.Chart(f).mark_line(point=True).encode(
        x=step_x(top, log, None), y=alt.Y("value:Q", title=y_title), color=colour,
        strokeWidth=alt.condition(alt.datum.series == EXACT, alt.value(3), alt.value(1.5)),
        tooltip=["series:N", alt.Tooltip("step:Q", format=","), alt.Tooltip("value:Q", format=".3~g"),
                 alt.Tooltip("stderr:Q", title="standard error", format=".2~g")])
    panels = [alt.layer(bars, lines).properties(width=700, height=170)]
    if comp_curve.height:
        panels.append(alt.Chart(comp_curve.cast({"step": pl.Float64})).mark_line(point=True, color="#4c78a8").encode(
            x=step_x(top, log), y=alt.Y("score:Q", title=["K-composition", follow], scale=alt.Scale(zero=False)),
            tooltip=[alt.Tooltip("step:Q", format=","), alt.Tooltip("score:Q", format=".4~g")]).properties(width=700, height=130))
    return alt.vconcat(*panels, spacing=6).properties(title=alt.TitleParams(
        f"The circuit edge {edge} over training: function and composition", anchor="start", fontSize=14,
        subtitleColor="#444", subtitle=[f"The edge: {html.unescape(rule)}.",
                                        "Top: its exact patching (black) and each attribution method, bars +-1 standard "
                                        "error over sequences (negative: carrying its corrupted value hurts induction).",
                                        "Bottom: its K-composition in the metric x space chosen as the caption below says."]))


def section(page: Page, con: duckdb.DuckDBPyConnection, d: Any) -> None:
    """The over-training chart of a model with a checkpoint series (``circuit_edge``, ``follow_cell``)."""
    stepped = d.checkpoints.filter(pl.col("checkpoint_step").is_not_null())
    if stepped.height < 2:
        return
    found = circuit_edge(con, d)
    if found is None:
        return
    (wl, wh), (rl, rh), rule = found
    name = f"{head(wl, wh)} → {head(rl, rh)}"
    rows = q.edge_over_training_all(con, d.model, (wl, wh), (rl, rh))
    st = stepped.select("checkpoint", pl.col("checkpoint_step").alias("step"))
    rows = rows.join(st, on="checkpoint").sort("step") if rows.height else rows
    if rows.height == 0 or rows["step"].n_unique() < 2:
        page.add(note(f"Edge attribution of the circuit edge {name} at {rows['step'].n_unique() if rows.height else 0} "
                      "checkpoint(s): no curve over training."))
        return
    fn = pl.concat([rows.select("step", series="method", value="attribution", stderr="attribution_stderr"),
                    rows.filter(pl.col("exact").is_not_null()).unique("step").select(
                        "step", series=pl.lit(EXACT), value="exact", stderr="exact_stderr")])
    exact = rows.filter(pl.col("exact").is_not_null()).unique("step").select("step", "exact")
    curves = q.pair_curves(con, d.model, ((rl, rh), (wl, wh)), stepped)
    chosen = follow_cell(curves, exact)
    if chosen is not None:
        (metric, space), rho, n = chosen
        caption = (f"Composition panel: <b>{html.escape(metric)} × {html.escape(space)}</b>, the metric x space whose "
                   f"K-composition of this edge follows its |exact patching| most closely over training (Spearman "
                   f"{fmt(rho)} over {n} checkpoints; highest of every metric x space scored).")
    elif d.lead is not None:
        metric, space = d.lead
        caption = (f"Composition panel: {html.escape(metric)} × {html.escape(space)} (the page's cell): too few "
                   "checkpoints with exact patching to choose by agreement with it.")
    else:
        metric, space, caption = "", "", ""
    curve = (curves.filter((pl.col("comp") == "K") & (pl.col("metric") == metric) & (pl.col("space") == space))
             .select("step", "score") if curves.height else pl.DataFrame())
    page.figure(training_chart(fn, curve, name, rule, f"({metric}, {space})"), f"{d.stem}__function_training")
    if caption:
        page.add(note(caption))
