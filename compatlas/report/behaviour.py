"""Induction behaviour of one model (forward passes: the induction-strength log-odds, head
scores, ablation): the A and B power histograms, B against the nearby-B token and a random
token, the head scores and ablation (a checkpoint slider where the model has several), and how
well composition picks out induction heads."""

from __future__ import annotations

import altair as alt
import polars as pl

from compatlas.atlas import MIN_CLASS, MIN_READERS  # below these counts the atlas's Spearman / AUROC are NULL
from compatlas.report.page import by_metric_space, correlation, note, order, table
from compatlas.tables import integer, number

HEAD_SCORE_TEXT = {"prev_token_mean": "previous-token score", "duplicate_mean": "duplicate-token score",
                   "induction_mean": "induction score", "ablation_drop": "drop in induction strength when ablated"}
POWER_COLUMNS = ("filler_before", "filler_between", "role", "mean", "stderr")
NEAR_COLUMNS = ("near_b_mean", "near_b_stderr", "random_mean", "random_stderr")


def _fillers(toks: pl.DataFrame) -> pl.DataFrame:
    return toks.with_columns(fillers=pl.format("{} before, {} between", "filler_before", "filler_between"))


def powers_chart(toks: pl.DataFrame, model: str, checkpoint: str) -> alt.Chart:
    """Histograms of A power and B power over tokens (Roger 2023, result 1: induction works much
    better for some tokens than for others)."""
    t = _fillers(toks).filter(pl.col("mean").is_finite()).select("fillers", "role", "mean")
    n_f = t["fillers"].n_unique()
    return alt.Chart(t).mark_bar(opacity=0.75, binSpacing=0).encode(
        x=alt.X("mean:Q", bin=alt.Bin(maxbins=30), title="power (mean induction strength of the token, log-odds)"),
        y=alt.Y("count():Q", title="tokens"),
        color=alt.Color("role:N", sort=["A", "B"], title="power of the token as",
                        scale=alt.Scale(domain=["A", "B"], range=["#4c78a8", "#f58518"])),
        row=alt.Row("role:N", sort=["A", "B"], title=None, header=alt.Header(labelExpr="datum.value + ' power'")),
        column=alt.Column("fillers:N", title="filler tokens"),
    ).properties(width=min(480, 900 // max(n_f, 1)), height=120, title=alt.TitleParams(
        f"{model} @ {checkpoint}: A power and B power", anchor="start", subtitleColor="#444", subtitle=[
            "Strength = logodds p(B | r.. A B r.. A) - logodds p(B | the same tokens shuffled, last A kept); "
            "A power: its mean over sequences with the token as A, B power: as B."]))


def near_b_chart(toks: pl.DataFrame, model: str, checkpoint: str) -> alt.FacetChart:
    """B against the nearby-B token B* and a random token R on the same sequences (result 2),
    mean over tokens with +-2 standard errors."""
    t = _fillers(toks).filter(pl.col("role") == "B")
    long = pl.concat([t.select("fillers", pl.lit(label).alias("target"), pl.col(m).alias("mean"), pl.col(se).alias("se"))
                      for label, m, se in (("B", "mean", "stderr"), ("nearby B*", "near_b_mean", "near_b_stderr"),
                                           ("random R", "random_mean", "random_stderr"))])
    s = long.group_by("fillers", "target").agg(pl.col("mean").mean(), (pl.col("se").pow(2).sum().sqrt() / pl.len()).alias("se"),
                                               pl.len().alias("tokens")).sort("fillers", "target")
    s = s.with_columns(lo=pl.col("mean") - 2 * pl.col("se"), hi=pl.col("mean") + 2 * pl.col("se"))
    targets = ["B", "nearby B*", "random R"]
    base = alt.Chart(s).encode(y=alt.Y("target:N", sort=targets, title=None))
    xt = "mean induction strength over tokens (± 2 s.e.)"
    bars = base.mark_bar().encode(x=alt.X("mean:Q", title=xt),
                                  color=alt.Color("target:N", sort=targets, legend=None),
                                  tooltip=["target", alt.Tooltip("mean:Q", format=".3g"), alt.Tooltip("se:Q", format=".2g"),
                                           "tokens"])
    err = base.mark_errorbar(ticks=True).encode(x=alt.X("lo:Q", title=xt), x2="hi:Q")
    return alt.layer(bars, err).properties(width=420, height=90).facet(row=alt.Row("fillers:N", title=None)).properties(
        title=alt.TitleParams(f"{model} @ {checkpoint}: is B's neighbourhood copied too?", anchor="start",
                              subtitleColor="#444", subtitle=[
                                  "Sequences with B fixed, scored for B, for B* (nearest to B by cosine in W_U, W_E "
                                  "when tied) and for a random token R."]))


def span(values: pl.Series) -> float:
    """The largest |value| (1 when there is none): half the width of a domain centred on 0."""
    present = values.drop_nulls()
    m = number(present.abs().max()) if present.len() else 0.0
    return m if m > 0 else 1.0


def head_scores_chart(heads: pl.DataFrame, model: str) -> alt.TopLevelMixin:
    """Layer x head maps of each behavioural score; with several checkpoints a slider over the
    step picks one (the maps' colours keep one scale over training)."""
    cols = [c for c in HEAD_SCORE_TEXT if c in heads.columns and heads[c].is_not_null().any()]
    steps = sorted(heads["step"].unique().to_list()) if "step" in heads.columns else []
    h = heads.select("layer", "head", *(pl.col(c).round(3) for c in cols), *(["step"] if steps else []))
    n_heads, n_layers = integer(h["head"].max()) + 1, integer(h["layer"].max()) + 1
    cell = max(4, min(28, (1180 // max(len(cols), 1) - 90) // n_heads))
    params, filt = [], None
    if len(steps) > 1:
        pick = alt.param(name="ckpt", value=steps[-1], bind=alt.binding_select(
            options=steps, labels=[f"step {s:,}" for s in steps], name="checkpoint: "))
        params, filt = [pick], "datum.step == ckpt"
    charts = []
    for col in cols:
        diverging = col == "ablation_drop"
        c = alt.Chart(h).mark_rect()
        if filt:
            c = c.transform_filter(filt)
        tip = ["layer:O", "head:O", alt.Tooltip(f"{col}:Q", format=".3f")] + (["step:Q"] if steps else [])
        charts.append(c.encode(
            x=alt.X("head:O", title="head"), y=alt.Y("layer:O", title="layer"),
            color=alt.Color(f"{col}:Q", title=None, scale=alt.Scale(
                scheme="redblue" if diverging else "viridis", reverse=diverging,
                # a diverging scale centred on 0 through a symmetric domain: domainMid outside the
                # data's range (every drop positive) makes Vega warn "domainMid exceeds domain"
                domain=[-span(h[col]), span(h[col])] if diverging else [0, 1]),
                legend=alt.Legend(orient="bottom", gradientLength=max(100, min(160, cell * n_heads)))),
            tooltip=tip).properties(width=max(110, cell * n_heads), height=min(420, max(80, 14 * n_layers)),
                                    title=HEAD_SCORE_TEXT[col]))
    chart = alt.hconcat(*charts).resolve_scale(color="independent")
    if params:
        chart = chart.add_params(*params)
    return chart.properties(title=alt.TitleParams(
        f"{model}: what each head does" + (" (slide through the checkpoints)" if params else ""), anchor="start",
        subtitleColor="#444", subtitle=["Attention on random tokens repeated twice: i -> i-1 (previous token), i -> i-T "
                                        "(duplicate), i -> i-T+1 (induction); scores in [0, 1]. Ablation: the head's "
                                        "output zeroed (or its mean), paired over the same sequences."]))


def _stats(r: dict) -> tuple:
    """AUROC and both Spearmans as the atlas gives them: NULL below MIN_CLASS heads of a class or
    MIN_READERS readers (composition_vs_behaviour)."""
    return r["auroc"], correlation(r["spearman_induction"]), correlation(r["spearman_ablation"])


PAYOFF_HEADER = ["metric", "space", "reader heads", "induction heads", "K discoveries", "K precision", "K recall",
                 "K AUROC", "K Spearman vs induction", "K Spearman vs ablation", "Q recall", "V recall"]
STATS_NOTE = (f"Spearman is shown from {MIN_READERS} reader heads up, AUROC with at least {MIN_CLASS} induction heads "
              f"and {MIN_CLASS} other readers; '–' otherwise. Precision / recall of the discoveries: of the readers "
              "with a discovery from a previous-token head, the share that are induction heads / of the induction "
              "heads, the share with such a discovery. Every comp: <code>SELECT * FROM composition_vs_behaviour</code>.")


def payoff_table(cvb: pl.DataFrame) -> str:
    """One row per metric x space: K-composition in full, Q and V by their recall."""
    if cvb.is_empty():
        return ""
    rows = []
    for metric, space, _, g in by_metric_space(cvb):
        k = g.get("K") or next(iter(g.values()))
        rows.append([metric, space, k["n_readers"], k["n_induction_heads"],
                     *((k.get("n_discoveries"), k.get("discovery_precision"), k.get("discovery_recall"), *_stats(k))
                       if "K" in g else (None,) * 6),
                     *(g[c].get("discovery_recall") if c in g else None for c in ("Q", "V"))])
    return note(STATS_NOTE) + table(PAYOFF_HEADER, rows)


def top_tokens(toks: pl.DataFrame, n: int = 8) -> str:
    """Top and bottom tokens (decoded) by A and B power, first filler setting."""
    first = toks.sort("filler_before", "filler_between").row(0, named=True)
    t = toks.filter((pl.col("filler_before") == first["filler_before"]) & (pl.col("filler_between") == first["filler_between"]))
    parts = []
    for role in order(t["role"].unique(), ("A", "B")):
        g = t.filter(pl.col("role") == role)
        for label, f in (("top", g.sort("mean", descending=True).head(n)), ("bottom", g.sort("mean").head(n))):
            rows = [[r["token_id"], repr(r.get("token_text")), r["mean"], r["stderr"]] for r in f.iter_rows(named=True)]
            parts.append(f"<div><b>{label} {n} by {role} power</b>" + table(["id", "token", "power", "s.e."], rows) + "</div>")
    return "<div class='side'>" + "".join(parts) + "</div>"
