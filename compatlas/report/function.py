"""Composition against function (docs/edge_attribution.md): per model, how well each metric x
space x comp's composition predicts edge attribution (composition_vs_function), the lead cell's
edges as a scatter with the circuit marked, and how far EAP agrees with exact patching; over
training, the circuit edge's attribution and composition on one step axis; on the overview,
which metric x space agrees best across models. An atlas without edge attribution gets none of
it and a line saying so."""

from __future__ import annotations

import html
from typing import Any

import altair as alt
import duckdb
import polars as pl

from compatlas.report import queries as q
from compatlas.report.page import Page, by_metric_space, fmt, head, note, order, table
from compatlas.report.training import log_axis, step_x
from compatlas.vocab import COMPS, EDGE_METHODS

CIRCUIT, OTHER = "previous-token head → induction head", "other edge"
COLUMNS = [("spearman", "auroc", "average_precision"), ("spearman_z", "auroc_z", "average_precision_z"),
           ("spearman_p", "auroc_p", "average_precision_p")]
WHAT = ("Each edge (writer head → a later reader's query, or its KV head's key or value) scored twice: by its "
        "<b>composition</b> (weights only) and by <b>edge attribution</b> (the change in the log-probability of the "
        "induced tokens when the edge alone carries its corrupted value; docs/edge_attribution.md). The <b>top of the "
        "function</b>: the fewest edges holding half of a comp's total |attribution|. Per metric x space x comp: "
        "Spearman of each score with |attribution| over all edges, and its mean within one (writer layer, reader "
        "layer) pair (the heads of a layer pair told apart, depth's scale taken out); AUROC and average precision "
        "of the score for the "
        "top set; the same for z (spectrum-kept null) and for p (smaller first); precision and recall of the "
        "discoveries against the top set.")


def _rounded(v: Any) -> Any:
    """A correlation of exactly 0 computed in floating point (4.4e-17) shown as 0."""
    return 0.0 if isinstance(v, float) and abs(v) < 1e-12 else v


def agreement_table(cvf: pl.DataFrame) -> str:
    rows = []
    for metric, space, _, by in by_metric_space(cvf):
        for comp in COMPS:
            if comp not in by:
                continue
            r = by[comp]
            rows.append([metric, space, comp, r["n_edges"], r["n_top"], _rounded(r.get("spearman")),
                         _rounded(r.get("spearman_within_layer_pair"))]
                        + [_rounded(r.get(c)) for cols in COLUMNS for c in cols if c != "spearman"]
                        + [r["n_discoveries"], r["discovery_precision"], r["discovery_recall"]])
    return table(["metric", "space", "comp", "edges", "top", "Spearman", "Spearman within a layer pair", "AUROC", "AP",
                  "Spearman z", "AUROC z", "AP z", "Spearman p", "AUROC p", "AP p", "discoveries", "precision", "recall"],
                 rows, cls="agree")


def method_line(methods: dict[str, str]) -> str:
    """Which attribution each comp's rows use, and by what rule (``queries.edge_methods``)."""
    parts = [f"{c} <b>{html.escape(m)}</b>" for c, m in methods.items()]
    return ("Attribution per comp, the method that agrees best with exact patching there (its top edge, then its "
            "Spearman; EAP on ties; the line below the table): " + "; ".join(parts) + ".")


def best_worst(cvf: pl.DataFrame) -> str:
    """One sentence naming the cells (metric x space x comp) whose score has the highest and the
    lowest AUROC for the top of the function."""
    g = cvf.filter(pl.col("auroc").is_not_null() & pl.col("auroc").is_not_nan()).sort(["auroc", "spearman"], descending=True, nulls_last=True)
    if g.is_empty():
        return "No cell has an AUROC (a comp needs edges both in and out of the top set)."

    def cell(r: dict[str, Any]) -> str:
        return (f"<b>{html.escape(r['metric'])} in {html.escape(r['space'])} space, {r['comp']}</b> (AUROC {fmt(r['auroc'])}, "
                f"Spearman {fmt(r['spearman'])})")
    best, worst = g.row(0, named=True), g.row(-1, named=True)
    return f"Best agreement with function: {cell(best)}; worst: {cell(worst)}."


def exact_line(eve: pl.DataFrame) -> str:
    """EAP (each method) against exact patching, per comp, in one line."""
    if eve.is_empty():
        return "No exact patching in this atlas for this model: the approximation is not checked here."
    parts = []
    for method in order(eve["method"].unique(), EDGE_METHODS):
        g = {r["comp"]: r for r in eve.filter(pl.col("method") == method).iter_rows(named=True)}
        bits = [f"{c} Spearman {fmt(g[c]['spearman'])}, top-{g[c].get('top_k') or 5} overlap {fmt(g[c]['top_k_overlap'])}"
                + ("" if g[c].get("top_edge_agrees") else " (top edge differs)") for c in COMPS if c in g]
        n = max(int(r["n_exact"] or 0) for r in g.values())
        parts.append(f"<b>{html.escape(method)}</b> against exact patching (up to {n} patched edges per comp): " + "; ".join(bits))
    return ". ".join(parts) + "."


def edge_points(df: pl.DataFrame, prev: pl.DataFrame, ind: pl.DataFrame, grouped: bool) -> pl.DataFrame:
    """One point per edge as composition_vs_function counts them: a K/V edge into a KV group is one
    edge, its composition the largest of the group's query heads. ``circuit``: the writer is a
    previous-token head and a reader head of the group an induction head."""
    pairs = {(int(r["layer"]), int(r["head"])) for r in prev.iter_rows(named=True)}
    inds = {(int(r["layer"]), int(r["head"])) for r in ind.iter_rows(named=True)}
    d = df.with_columns(
        is_prev=pl.struct("writer_layer", "writer_head").map_elements(lambda s: (s["writer_layer"], s["writer_head"]) in pairs,
                                                                       return_dtype=pl.Boolean),
        is_ind=pl.struct("reader_layer", "reader_head").map_elements(lambda s: (s["reader_layer"], s["reader_head"]) in inds,
                                                                      return_dtype=pl.Boolean))
    unit = "reader_kv_head" if grouped else "reader_head"
    out = d.group_by("writer_layer", "writer_head", "reader_layer", unit).agg(
        pl.col("score").max(), pl.col("attribution").first(), pl.col("attribution_stderr").first(),
        (pl.col("is_prev").first() & pl.col("is_ind").any()).alias("circuit"))
    label = (pl.lit("L") + pl.col("reader_layer").cast(pl.Utf8) + (pl.lit(".KV") if grouped else pl.lit(".H"))
             + pl.col(unit).cast(pl.Utf8))
    return out.select(
        edge=pl.lit("L") + pl.col("writer_layer").cast(pl.Utf8) + "." + pl.lit("H") + pl.col("writer_head").cast(pl.Utf8)
        + pl.lit(" → ") + label,
        score="score", attribution="attribution", fn=pl.col("attribution").abs(), stderr="attribution_stderr",
        kind=pl.when("circuit").then(pl.lit(CIRCUIT)).otherwise(pl.lit(OTHER))).sort("kind", descending=True)


def scatter_chart(pts: pl.DataFrame, model: str, checkpoint: str, method: str, metric: str, space: str) -> alt.LayerChart:
    """Composition score (x) against |attribution| (y, symlog) of every K edge, the circuit's drawn over the rest."""
    positive = pts.filter(pl.col("fn") > 0)["fn"]
    constant = float(positive.median()) if len(positive) else 1.0  # linear below the typical edge, logarithmic above
    y = alt.Y("fn:Q", title="|edge attribution| (log-prob of induced tokens)",
              scale=alt.Scale(type="symlog", constant=constant))
    x = alt.X("score:Q", title=f"K-composition score ({metric}, {space} space)", scale=alt.Scale(zero=False))
    tip = ["edge:N", alt.Tooltip("score:Q", format=".4f"), alt.Tooltip("attribution:Q", format=".4f"),
           alt.Tooltip("stderr:Q", title="standard error", format=".4f")]
    n_circ = int((pts["kind"] == CIRCUIT).sum())
    kinds = [(k, c) for k, c, n in ((CIRCUIT, "#e45756", n_circ), (OTHER, "#9a9a9a", pts.height - n_circ)) if n]
    colour = alt.Color("kind:N", title=None, scale=alt.Scale(domain=[k for k, _ in kinds], range=[c for _, c in kinds]),
                       legend=alt.Legend(orient="top", labelLimit=320))
    others = alt.Chart(pts.filter(pl.col("kind") == OTHER)).mark_circle(size=14, opacity=0.35).encode(
        x=x, y=y, color=colour, tooltip=tip)
    circ = alt.Chart(pts.filter(pl.col("kind") == CIRCUIT)).mark_point(size=70, filled=True, opacity=0.95,
                                                                       stroke="black", strokeWidth=0.6).encode(
        x=x, y=y, color=colour, tooltip=tip)
    n_circ_txt = (f"{n_circ} from a previous-token head into an induction head, red" if n_circ else
                  "no head scores name a previous-token and an induction head, so no circuit edge is marked")
    return alt.layer(*[c for c, n in ((others, pts.height - n_circ), (circ, n_circ)) if n]).properties(width=560, height=340, title=alt.TitleParams(
        f"{model} @ {checkpoint}: K-composition against function", anchor="start", fontSize=14, subtitleColor="#444",
        subtitle=[f"Each point a K edge ({pts.height:,}; {n_circ_txt}). "
                  f"Attribution by {method}; y on a symlog scale (linear below {constant:.2g})."]))


def _eventual_edge(d: Any) -> tuple[tuple[int, int], tuple[int, int]] | None:
    if d.outcome is None or d.outcome.pair is None:
        return None
    (il, ih), (pl_, ph) = d.outcome.pair
    return (pl_, ph), (il, ih)


def training_chart(fn: pl.DataFrame, comp_curve: pl.DataFrame, edge: str, method: str, metric: str, space: str) -> alt.VConcatChart:
    """The circuit edge's attribution (with +-1 standard error) and its K-composition, over one step axis."""
    top = float(max(fn["step"].max(), comp_curve["step"].max() if comp_curve.height else 0))
    log = log_axis(pl.concat([fn["step"], comp_curve["step"]]) if comp_curve.height else fn["step"])
    f = fn.with_columns(lo=pl.col("attribution") - pl.col("attribution_stderr"),
                        hi=pl.col("attribution") + pl.col("attribution_stderr")).cast({"step": pl.Float64})
    y_title = ["edge attribution", f"({method})"]  # on both layers: a layer without it drops the shared axis title
    band = alt.Chart(f).mark_errorbar(color="#e45756").encode(x=step_x(top, log, None), y=alt.Y("lo:Q", title=y_title), y2="hi:Q")
    line = alt.Chart(f).mark_line(point=True, color="#e45756").encode(
        x=step_x(top, log, None), y=alt.Y("attribution:Q", title=y_title),
        tooltip=[alt.Tooltip("step:Q", format=","), alt.Tooltip("attribution:Q", format=".4f"),
                 alt.Tooltip("attribution_stderr:Q", title="standard error", format=".4f")])
    panels = [alt.layer(band, line).properties(width=700, height=140)]
    if comp_curve.height:
        panels.append(alt.Chart(comp_curve.cast({"step": pl.Float64})).mark_line(point=True, color="#4c78a8").encode(
            x=step_x(top, log), y=alt.Y("score:Q", title=["K-composition", f"({metric}, {space})"], scale=alt.Scale(zero=False)),
            tooltip=[alt.Tooltip("step:Q", format=","), alt.Tooltip("score:Q", format=".4f")]).properties(width=700, height=140))
    return alt.vconcat(*panels, spacing=6).properties(title=alt.TitleParams(
        f"The circuit edge {edge} over training: function and composition", anchor="start", fontSize=14,
        subtitleColor="#444", subtitle=["Top: its edge attribution (negative: carrying its corrupted value hurts "
                                        "induction), bars +-1 standard error over sequences. Bottom: its K-composition."]))


def section(page: Page, con: duckdb.DuckDBPyConnection, d: Any, cuts: tuple[float, float]) -> None:
    """The model page's section; nothing at all where the atlas has no edge attribution view."""
    if not q.has(con, "composition_vs_function", "method", "auroc"):
        return
    page.add("<h2 id='function'>Composition against function</h2>")
    methods = q.edge_methods(con, d.model, d.latest)
    if methods is None:
        page.add(note("No edge attribution for this model (edge attribution disabled, or a one-layer model)."))
        return
    method = methods["K"]
    cvf = q.function_agreement(con, d.model, d.latest, methods)
    page.add(note(WHAT + " " + method_line(methods)), f"<p>{best_worst(cvf)}</p>", agreement_table(cvf),
             f"<p>{exact_line(q.eap_vs_exact(con, d.model, d.latest))}</p>")
    if d.lead is not None:
        df = q.edge_scatter(con, d.model, d.latest, method, *d.lead)
        if not df.is_empty():
            grouped = d.info.get("n_kv_heads") not in (None, d.info.get("n_heads"))
            pts = edge_points(df, *d.roles(*cuts), grouped)
            page.figure(scatter_chart(pts, d.model, d.latest, method, *d.lead), f"{d.stem}__function_scatter")
    edge = _eventual_edge(d)
    if edge is not None:
        (wl, wh), (rl, rh) = edge
        fn = q.edge_over_training(con, d.model, (wl, wh), (rl, rh), method)
        st = d.checkpoints.select("checkpoint", pl.col("checkpoint_step").alias("step"))
        fn = fn.join(st, on="checkpoint").drop_nulls("step").sort("step") if fn.height else fn
        name = f"{head(wl, wh)} → {head(rl, rh)}"
        if fn.height >= 2:
            c = d.outcome.curves
            curve = (c.filter((pl.col("comp") == "K") & (pl.col("metric") == d.lead[0]) & (pl.col("space") == d.lead[1]))
                     .select("step", "score") if d.lead is not None and c.height else pl.DataFrame())
            metric, space = d.lead or ("", "")
            page.figure(training_chart(fn, curve, name, method, metric, space), f"{d.stem}__function_training")
        else:
            page.add(note(f"Edge attribution of the circuit edge {name} at {fn.height} checkpoint(s): no curve over training."))


def overview_table(con: duckdb.DuckDBPyConnection, data: list[Any]) -> str:
    """Mean AUROC of the K-composition score for the top of the function, per metric x space over
    the models with edge attribution (each at its last checkpoint, its page's method)."""
    if not q.has(con, "composition_vs_function", "method", "auroc"):
        return ""
    frames = []
    for d in data:
        method = q.edge_method(con, d.model, d.latest)
        if method is not None:
            frames.append(q.function_agreement(con, d.model, d.latest, method).filter(pl.col("comp") == "K")
                          .select("metric", "space", "auroc", "spearman", model=pl.lit(d.model)))
    head_ = "<h2 id='function'>Which metric x space agrees with function</h2>"
    if not frames:
        return head_ + note("No model in this atlas has edge attribution.")
    k = pl.concat(frames).filter(pl.col("auroc").is_not_null() & pl.col("auroc").is_not_nan())
    if k.is_empty():
        return head_ + note("No model has a K AUROC against edge attribution.")
    models = k["model"].unique(maintain_order=True).to_list()
    agg = k.group_by("metric", "space").agg(pl.col("auroc").mean().alias("mean"), pl.col("spearman").mean().alias("rho"),
                                            pl.len().alias("n")).sort(["n", "mean"], descending=True)
    per = {(r["metric"], r["space"], r["model"]): r["auroc"] for r in k.iter_rows(named=True)}
    rows = [[r["metric"], r["space"], r["mean"], r["rho"], r["n"], *[per.get((r["metric"], r["space"], m)) for m in models]]
            for r in agg.iter_rows(named=True)]
    best = agg.row(0, named=True)
    return (head_ + note("K-composition against edge attribution (the model page's method, last checkpoint): AUROC of the "
                         "composition score for the fewest edges holding half the |attribution|, averaged over models; "
                         "the metric x space scored on the most models first, then by mean AUROC; details on each "
                         "model's page.")
            + f"<p>Agrees best across models: <b>{html.escape(best['metric'])} in {html.escape(best['space'])} space</b> "
              f"(mean AUROC {fmt(best['mean'])} over {best['n']} model{'s' if best['n'] != 1 else ''}).</p>"
            + table(["metric", "space", "mean AUROC", "mean Spearman", "models", *[f"AUROC {m}" for m in models]], rows))
