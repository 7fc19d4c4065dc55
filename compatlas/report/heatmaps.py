"""The head x head heatmap of one model x checkpoint x metric x space, coloured by the
calibrated answer (-log10 p against the model's own non-causal pairs, so the pairs that stand
out of that null stand out), and the calibration summary table of every metric x space x comp."""

from __future__ import annotations

import math
from typing import Any

import altair as alt
import numpy as np
import polars as pl

from compatlas.report.page import by_metric_space, finite, note, order, table, wrap
from compatlas.tables import integer, number
from compatlas.vocab import COMPS

HEATMAP_DATA = "heatmap"  # name of the heatmap's dataset in the spec's top-level "datasets"
HEATMAP_FOUND = "heatmap_found"  # and of its discoveries (``heatmap_found``): decided on the exact q
# Above this many cells a heatmap gets no PNG file (drawing it takes vl-convert about 13 s per
# 200k cells); the page's figure menu exports one on request.
PNG_MAX_CELLS = 60_000
DISCOVERY_MARK = "#00c8ff"  # outline of a discovery's cell: apart from every colour of the inferno scale
PANEL_MAX, PANEL_MIN, CELL_PX = 720, 260, 12  # px: the panel's side, and a cell's where the model is small

METRIC_TEXT = {
    "frobenius": "||L R||_F / (||L||_F ||R||_F) (Elhage et al. 2021)",
    "svd_bound": "||L R||_F / sqrt(sum_i s_i(L)^2 s_i(R)^2): 1 = singular vectors aligned",
    "subspace": "mean cos^2 of the principal angles between write and read subspaces",
    "contribution": "||L R||_F, a magnitude: the RMS of what the writer adds to the reader's logit (Q, K) or output (V)",
    "pattern_output": "a magnitude: the RMS first-order change of the reader's output when the writer's output moves its "
                      "query (Q) or key (K), through its pattern, or its value (V), on the model's own text",
}
SPACE_TEXT = {
    "residual": "weights acting on the residual stream",
    "token": "exact token space (invariant under every change of residual basis)",
    "token_norm": "token space of W_E's rows normalised as the first norm would",
    "activation": "the model's own activation statistics over a text sample (moments of q, k, v and z)",
}


def _scaled(col: str, k: float) -> pl.Expr:
    """A float column as integers of 1/k (compact JSON), null where not finite."""
    c = pl.col(col)
    return pl.when(c.is_finite()).then((c * k).round(0).cast(pl.Int64)).otherwise(None)


def score_scale(df: pl.DataFrame) -> float:
    """The factor the heatmap stores scores and null means by, as integers: three significant
    digits of the largest |score| (1e3 for the normalised metrics' [0, 1]; 10 for a magnitude of
    tens, whose scores at 1e3 would be five-digit integers, and whose small values at a fixed
    1e3 would read 0)."""
    top = number(df["score"].abs().max()) if df.height else 1.0
    return float(10 ** (2 - math.floor(math.log10(top)))) if finite(top) and top > 0 else 1e3


def _neg_log10(col: str) -> pl.Expr:
    return -pl.col(col).cast(pl.Float64).clip(1e-300).log10()


def heatmap_rows(df: pl.DataFrame, H: int, q_cut: float | None = None) -> list[dict[str, Any]]:
    """The heatmap's data, compact: one row per (comp, writer head index w = layer * H + head) with
    arrays over reader heads r0, r0 + 1, ...: score and spectrum-kept null mean (s, m, in 1 /
    ``score_scale``), z (1e-1), -log10 p (lp, 1e-2), -log10 q (lq, 1e-2); null where missing.

    lq is rounded away from the false discovery rate ``q_cut``: up (a smaller q) for a
    discovery, down for the rest, so that the q a tooltip decodes is on the same side of the
    threshold as the exact q. Which pairs are discoveries is never decided from lq: ``heatmap_found``
    carries them, decided on the exact q."""
    k = score_scale(df)
    lq = pl.col("lq") * 100
    found = pl.col("q_value") <= q_cut if q_cut is not None else pl.lit(False)
    d = df.with_columns(
        w=pl.col("writer_layer") * H + pl.col("writer_head"), r=pl.col("reader_layer") * H + pl.col("reader_head"),
        z=(pl.col("score") - pl.col("baseline_spectrum_mean")) / pl.col("baseline_spectrum_std"),
        lp=_neg_log10("p_value"), lq=_neg_log10("q_value"),
    ).with_columns(s=_scaled("score", k), m=_scaled("baseline_spectrum_mean", k), zz=_scaled("z", 10),
                   lpp=_scaled("lp", 100),
                   lqq=pl.when(pl.col("lq").is_finite()).then(
                       pl.when(found).then(lq.ceil()).otherwise(lq.floor()).cast(pl.Int64)).otherwise(None))
    out: list[dict[str, Any]] = []
    nn = df["n_null"].max() if "n_null" in df.columns else None
    for (comp, w), g in d.sort(["comp", "w", "r"]).group_by(["comp", "w"], maintain_order=True):
        r = g["r"].to_numpy()
        r0, n = int(r[0]), int(r[-1] - r[0] + 1)
        gm = g["baseline_gaussian_mean"].mean() if "baseline_gaussian_mean" in g.columns else None
        # the Gaussian null depends only on the heads' shapes: one value per row (their mean)
        row: dict[str, Any] = {"c": comp, "w": int(w), "r0": r0, "nn": nn, "gm": round(number(gm), 4) if finite(gm) else None}
        for key, col in (("s", "s"), ("m", "m"), ("z", "zz"), ("lp", "lpp"), ("lq", "lqq")):
            arr: list[Any] = [None] * n
            for ri, v in zip((r - r0).tolist(), g[col].to_list()):
                arr[ri] = v
            row[key] = arr
        out.append(row)
    return out


def heatmap_found(df: pl.DataFrame, H: int, q_cut: float | None) -> list[dict[str, Any]]:
    """The heatmap's discoveries (dataset HEATMAP_FOUND): a row per pair whose exact q is at most
    ``q_cut`` (the ``discoveries`` view's rule, a query head's row of a key/value head's test
    included), with its exact score, z, p and q: the cyan squares and their tooltips."""
    if q_cut is None or "q_value" not in df.columns:
        return []
    d = df.filter(pl.col("q_value") <= q_cut).with_columns(
        z=(pl.col("score") - pl.col("baseline_spectrum_mean")) / pl.col("baseline_spectrum_std"))
    return [{"c": r["comp"], "w": r["writer_layer"] * H + r["writer_head"], "r": r["reader_layer"] * H + r["reader_head"],
             "score": r["score"], "zval": r["z"] if finite(r["z"]) else None, "p": r["p_value"], "q": r["q_value"]}
            for r in d.sort("comp", "writer_layer", "writer_head", "reader_layer", "reader_head").iter_rows(named=True)]


HEAD_LABEL_PX = 40  # px: cells at least this large get a label per head ("L0.H1"), not per layer


def _layer_axis(title: str, lo: int, hi: int, H: int, x: bool, side: int) -> alt.Axis:
    """Labels per layer ("L3", at its first head) or, where a head's cell has room, per head
    ("L0.H1", at the cell's middle): a 2-layer, 2-head model's map is four large cells, which
    per-layer labels and no borders drew as one block."""
    if side / max((hi - lo) * H, 1) >= HEAD_LABEL_PX:
        return alt.Axis(title=title, values=[i + 0.5 for i in range(lo * H, hi * H)],
                        labelExpr=f"'L' + floor(datum.value / {H}) + '.H' + floor(datum.value % {H})", grid=False,
                        ticks=False, labelFontSize=10, labelAngle=0, labelAlign="center" if x else "right",
                        labelBaseline="top" if x else "middle", labelOverlap=True)
    every = max(1, math.ceil((hi - lo) * 18 / side))  # a label at most every 18 px
    return alt.Axis(title=title, values=[layer * H for layer in range(lo, hi, every)],
                    labelExpr=f"'L' + round(datum.value / {H})", grid=True, gridColor="white", gridWidth=0.5,
                    ticks=False, labelFontSize=10, labelAngle=0, labelAlign="left" if x else "right",
                    labelBaseline="middle" if x else "top", labelOverlap=True, labelFlush=False, zindex=1)


def heatmap_chart(df: pl.DataFrame, model: str, checkpoint: str, metric: str, space: str, H: int,
                  q_cut: float | None) -> alt.Chart:
    """One writer x reader panel, the comp chosen by radio buttons (K first: induction circuits
    compose through keys). Colour: -log10 p where calibrated, else the z against the spectrum-kept
    null. The chart reads the named dataset HEATMAP_DATA (``heatmap_rows``)."""
    calibrated = df["q_value"].is_not_null().any()
    w_lo, w_hi = integer(df["writer_layer"].min()), integer(df["writer_layer"].max()) + 1
    r_lo, r_hi = integer(df["reader_layer"].min()), integer(df["reader_layer"].max()) + 1
    n_w, n_r = (w_hi - w_lo) * H, (r_hi - r_lo) * H
    side = max(PANEL_MIN, min(PANEL_MAX, CELL_PX * max(n_w, n_r)))
    width, height = max(120, round(side * n_r / max(n_w, n_r))), max(120, round(side * n_w / max(n_w, n_r)))
    comps = order(df["comp"].unique().to_list(), ("K", "Q", "V"))
    pick = alt.param(name="comp", value=comps[0], bind=alt.binding_radio(options=comps, name="composition: "))
    k = score_scale(df)
    if calibrated:  # p rather than q: BH's step-up flattens q over most pairs, p keeps their order
        top = float(np.nanmax(-np.log10(df["p_value"].drop_nulls().to_numpy().clip(1e-300)))) if df.height else 1.0
        cmax = max(2.0, math.ceil(min(top, 10.0)))
        # a clamped top (p below 1e-10) is labelled as such: "≥ 10"
        colour = alt.Color("col:Q", title=["-log10 p", "(vs non-causal pairs)"],
                           scale=alt.Scale(scheme="inferno", reverse=True, domain=[0, cmax], clamp=True),
                           legend=alt.Legend(gradientLength=min(height, 220), titleFontSize=11,
                                             labelExpr=f"datum.value >= {cmax:g} ? '≥ ' + datum.label : datum.label"
                                             if top > cmax else alt.Undefined))
        what = ("Colour: -log10 p of the pair's score against this model's own non-causal pairs (a reader in a "
                "layer below its writer's); q (Benjamini-Hochberg) in the tooltip"
                + (f", discoveries: q <= {q_cut:g}." if q_cut is not None else "."))
        col_expr = "datum.lp / 100"
    else:
        z = ((df["score"] - df["baseline_spectrum_mean"]) / df["baseline_spectrum_std"]).to_numpy()
        zmax = float(np.nanmax(np.abs(z[np.isfinite(z)]))) if np.isfinite(z).any() else 1.0
        colour = alt.Color("col:Q", title="z (spectrum-kept null)",
                           # centred on 0 through a symmetric domain (a domainMid outside one-sided data warns)
                           scale=alt.Scale(scheme="redblue", reverse=True, domain=[-zmax, zmax]),
                           legend=alt.Legend(titleFontSize=11))
        what = "Colour: z against the pair's spectrum-kept null (this atlas has no calibration)."
        col_expr = "datum.z / 10"
    labels = {"writer": f"'L' + floor(datum.w / {H}) + '.H' + (datum.w % {H})",
              "reader": f"'L' + floor(datum.r / {H}) + '.H' + (datum.r % {H})"}
    base = (
        alt.Chart(alt.Data(name=HEATMAP_DATA))
        .transform_filter("datum.c == comp")
        .transform_flatten(["s", "m", "z", "lp", "lq"])
        .transform_window(i="row_number()", groupby=["c", "w"])
        .transform_filter("isValid(datum.s)")
        .transform_calculate(r="datum.r0 + datum.i - 1", col=col_expr, score=f"datum.s / {k:g}",
                             null_mean=f"datum.m / {k:g}", zval="datum.z / 10",
                             p="isValid(datum.lp) ? pow(10, -datum.lp / 100) : null",
                             q="isValid(datum.lq) ? pow(10, -datum.lq / 100) : null")
        .transform_calculate(w1="datum.w + 1", r1="datum.r + 1", **labels,
                             null_sd="datum.zval ? (datum.score - datum.null_mean) / datum.zval : null")
    )
    cell = max(width / max(n_r, 1), height / max(n_w, 1))
    rect = (
        # cells of 8 px and more are parted by a white line: four equal cells of a 2 x 2 model read as four
        base.mark_rect(strokeWidth=1 if cell >= 8 else 0, stroke="white")
        .encode(
            x=alt.X("r:Q", scale=alt.Scale(domain=[r_lo * H, r_hi * H], nice=False, zero=False),
                    axis=_layer_axis("reader head (layer, then head)", r_lo, r_hi, H, True, width)),
            x2="r1:Q",
            y=alt.Y("w:Q", scale=alt.Scale(domain=[w_lo * H, w_hi * H], nice=False, zero=False, reverse=True),
                    axis=_layer_axis("writer head (layer, then head)", w_lo, w_hi, H, False, height)),
            y2="w1:Q", color=colour,
            tooltip=[alt.Tooltip("writer:N"), alt.Tooltip("reader:N"), alt.Tooltip("c:N", title="comp"),
                     alt.Tooltip("score:Q", format=".3~g"),
                     alt.Tooltip("null_mean:Q", title="spectrum-kept null mean", format=".3~g"),
                     alt.Tooltip("null_sd:Q", title="spectrum-kept null sd", format=".3g"),
                     alt.Tooltip("gm:Q", title="Gaussian null mean", format=".3f"),
                     alt.Tooltip("zval:Q", title="z", format=".1f"),
                     alt.Tooltip("nn:Q", title="non-causal null pairs", format=","),
                     # q rounded away from the FDR (heatmap_rows): never across it
                     alt.Tooltip("p:Q", format=".2e"), alt.Tooltip("q:Q", format=".2e")])
    )
    layers = [rect]
    if calibrated and q_cut is not None:  # the discoveries, marked: colour alone hides a few cells among 35k
        # from their own dataset, decided on the exact q (a q of 0.0499986 read back from a rounded
        # -log10 q was 0.0501, and a filter on it drew none of the discoveries)
        layers.append(
            alt.Chart(alt.Data(name=HEATMAP_FOUND), name="discoveries")
            .transform_filter("datum.c == comp")
            .transform_calculate(rc="datum.r + 0.5", wc="datum.w + 0.5", **labels)
            .mark_point(shape="square", filled=False, color=DISCOVERY_MARK, strokeWidth=1.5, opacity=1,
                        size=max(36.0, (cell + 2) ** 2))
            .encode(x=alt.X("rc:Q"), y=alt.Y("wc:Q"),
                    tooltip=[alt.Tooltip("writer:N"), alt.Tooltip("reader:N"), alt.Tooltip("c:N", title="comp"),
                             alt.Tooltip("score:Q", format=".4~g"), alt.Tooltip("zval:Q", title="z", format=".1f"),
                             alt.Tooltip("p:Q", format=".3~e"), alt.Tooltip("q:Q", title="q (a discovery)", format=".6~g")]))
        what += f" Cyan squares: the discoveries (q <= {q_cut:g})."
    chart = alt.layer(*layers).add_params(pick).properties(width=width, height=height, title=alt.TitleParams(
        f"{model} @ {checkpoint}: {metric}, {space} space",
        subtitle=wrap([f"score = {METRIC_TEXT.get(metric, metric)}; space: {SPACE_TEXT.get(space, space)}.",
                       "Rows: writer head; columns: reader head in a later layer. " + what,
                       "Pick Q, K or V below; hover a cell for score, nulls, z, p and q."], font_px=11),
        anchor="start", fontSize=14, subtitleFontSize=11, subtitleColor="#444"))
    return chart.configure_view(stroke="#999", fill="#f4f4f4")


def lead_combo(available: list[tuple[str, str]]) -> tuple[str, str]:
    """The metric x space the pages lead with: token-space subspace (the one metric x space that
    passes all four of Lieberum's axioms in the metric audit), else the first in the usual order."""
    prefer = [(m, s) for m in ("subspace", "svd_bound", "frobenius") for s in ("token", "token_norm", "residual")]
    return next((c for c in prefer if c in available), sorted(available)[0])


def calibration_table(summary: pl.DataFrame) -> str:
    """One row per metric x space: discoveries per comp beside the mean score and nulls."""
    if summary.is_empty():
        return ""
    rows = []
    for metric, space, g, by in by_metric_space(summary):
        rows.append([metric, space, integer(g["pairs"].max()), *(by[c]["discoveries"] if c in by else None for c in COMPS),
                     *(by[c]["mean_score"] if c in by else None for c in COMPS),
                     g["gaussian_null"].mean(), g["spectrum_null"].mean(), g["n_null"].max()])
    return table(["metric", "space", "head pairs per comp", "Q discoveries", "K discoveries", "V discoveries",
                  "Q mean score", "K mean score", "V mean score", "mean Gaussian null", "mean spectrum-kept null",
                  "non-causal null pairs"], rows) + note(
        "Discoveries count rows of <code>discoveries</code>, one per reader query head: a finding of a key/value head "
        "counts once for each of its query heads (the function table below counts it once, as an edge).")
