"""The audits: per model, which scores survive a change of residual basis (invariance); across
metrics, which of Lieberum's axioms each metric x space satisfies (metric audit)."""

from __future__ import annotations

import html

import altair as alt
import polars as pl

from compatlas.report.page import note, order
from compatlas.tables import number
from compatlas.vocab import METRICS, SPACES, TRANSFORMS

AXIOM_TEXT = {
    "axiom1_full": "Axiom 1: writes only where the reader reads → 1",
    "axiom2_zero": "Axiom 2: orthogonal write/read spaces → 0",
    "axiom3_monotone_smooth": "Axiom 3: rotating the write space in raises it monotonically, smoothly",
    "axiom4_invariant": "Axiom 4: unchanged by any change of residual basis",
}


def invariance_chart(inv: pl.DataFrame, model: str, checkpoint: str) -> alt.FacetChart:
    """Worst rank correlation (over Q/K/V) with the untransformed scores, per transform, metric, space."""
    agg = inv.group_by("transform", "metric", "space").agg(
        pl.col("spearman").min(), pl.col("max_abs_change").max().alias("change"),
        pl.col("top_k_overlap").min(), pl.col("top_k").first().alias("k"),
    ).sort("transform", "metric", "space")  # sorted: a page the same every build
    k = int(agg["k"][0]) if agg["k"][0] is not None else 0
    lo = min(0.0, number(agg["spearman"].min()))
    n_m = agg["metric"].n_unique()
    return alt.Chart(agg).mark_bar().encode(
        x=alt.X("transform:N", sort=list(TRANSFORMS), title="change of residual basis x → x T",
                axis=alt.Axis(labelAngle=-30)),
        xOffset=alt.XOffset("space:N", sort=list(SPACES)),
        y=alt.Y("spearman:Q", title="worst Spearman with the original scores", scale=alt.Scale(domain=[lo, 1.0])),
        color=alt.Color("space:N", sort=list(SPACES), title="space"),
        column=alt.Column("metric:N", sort=list(METRICS), title=None),
        tooltip=["metric", "space", "transform", alt.Tooltip("spearman:Q", format=".4f"),
                 alt.Tooltip("change:Q", title="max |change|", format=".2e"),
                 alt.Tooltip("top_k_overlap:Q", title=f"top-{k} kept (worst)", format=".2f")],
    ).properties(width=min(300, 1000 // max(n_m, 1)), height=170, title=alt.TitleParams(
        f"{model} @ {checkpoint}: which scores survive a change of basis?", anchor="start", subtitleColor="#444",
        subtitle=["Bars at 1: the ranking of head pairs is unchanged. Every transform is a symmetry of the model "
                  "(norms aside); only token space survives diagonal scaling and GL(n)."]))


def metric_audit_table(df: pl.DataFrame) -> str:
    """Metrics (x space) as rows, axioms as columns: pass/fail with the measured values."""
    if df.is_empty():
        return ""
    axioms = [a for a in AXIOM_TEXT if a in set(df["axiom"])]
    rows = []
    for metric in order(df["metric"].unique(), METRICS):
        for space in order(df.filter(pl.col("metric") == metric)["space"].unique(), SPACES):
            cells = [f"<b>{html.escape(metric)}</b>", html.escape(space)]
            for a in axioms:
                g = df.filter((pl.col("metric") == metric) & (pl.col("space") == space) & (pl.col("axiom") == a))
                ok = bool(g["passed"].all())
                vals = "; ".join(f"{c}: {v:.3g}" for c, v in zip(g["construction"], g["value"]) if v is not None)
                cells.append(f"<span class='{'pass' if ok else 'fail'}'>{'PASS' if ok else 'FAIL'}</span>"
                             f"<br><small>{html.escape(vals)}</small>")
            rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{html.escape(h)}</th>" for h in ["metric", "space", *[AXIOM_TEXT[a] for a in axioms]])
    return ("<h2 id='axioms'>Which metric satisfies which axiom?</h2>"
            + note("Canonical constructions (the Frobenius score's pathologies and Lieberum's axioms): "
                   "identity with identity at d = 4, 16, 64; the rank-1 constant-rows/columns pair; "
                   "a writer inside / orthogonal to the reader's subspace; a 21-step "
                   "rotation of the write space into the read space (value = rise from orthogonal to aligned); a "
                   "random model under every transform class (value = max change). "
                   "<code>SELECT * FROM metric_audit</code>.")
            + f"<table class='audit'><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>")
