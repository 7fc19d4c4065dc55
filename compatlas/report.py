"""The atlas report: one self-contained HTML page plus one PNG per figure.

Reads only the ``composition`` and ``models`` views of ``results/atlas.duckdb`` (read-only)
and writes into ``out_dir``:

- ``index.html``: a models table, then a section per model and checkpoint with, for every
  space and metric, an interactive head x head heatmap (Q/K/V panels), the score
  distribution against both null baselines, a summary table and the top pairs by z-score.
  The Vega, Vega-Lite and vega-embed JavaScript is inlined (from ``vl-convert-python``),
  so the page works with no network.
- ``{model}__{checkpoint}__{metric}__{space}__heatmap.png`` and ``...__distribution.png``,
  rendered by ``vl-convert-python``. Characters outside ``[A-Za-z0-9._+-]`` in the names
  (e.g. the ``/`` of a Hugging Face name) become ``-``.

Data is kept compact so that a model of ~300 heads stays a few MB per metric: the heatmap
ships one row per (comp, writer head) holding the rounded scores of all its reader heads as
an array (Vega-Lite flattens it in the browser), and histograms are binned here.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import altair as alt
import duckdb
import numpy as np
import polars as pl

from compatlas.storage import atomic_path

COMPS = ("Q", "K", "V")
METRIC_ORDER = ("frobenius", "svd_bound", "subspace")
SPACE_ORDER = ("residual", "token", "token_norm")

# metric -> (formula, plain-words explanation)
METRIC_TEXT: dict[str, tuple[str, str]] = {
    "frobenius": (
        "||L R||_F / (||L||_F ||R||_F)",
        "Frobenius norm of the product of the writer's OV matrix L and the reader's matrix R, "
        "relative to the product of their norms (Elhage et al. 2021)",
    ),
    "svd_bound": (
        "||L R||_F / sqrt(sum_i s_i(L)^2 s_i(R)^2)",
        "Frobenius norm of L R relative to the largest value it can reach given the singular "
        "values s_i of L and R (1 = singular vectors perfectly aligned)",
    ),
    "subspace": (
        "mean cos^2 of the principal angles",
        "overlap between the subspace the writer head writes to and the subspace the reader "
        "head reads from, ignoring magnitudes (1 = same subspace, 0 = orthogonal)",
    ),
}
COMP_TEXT = {
    "Q": "reader's queries (R = W_Q W_K^T)",
    "K": "reader's keys (R = W_K W_Q^T)",
    "V": "reader's values (R = W_V W_O)",
}
SPACE_TEXT = {
    "residual": "weights acting on the residual stream",
    "token": "exact token space: W_E = Q R_E, the residual basis z = x R_E^-1 (invariant under every change of residual basis)",
    "token_norm": "token space of W_E's rows normalised as the first norm would, its weight folded",
}
TRANSFORM_ORDER = ("permutation", "orthogonal", "orthogonal_scale", "diagonal", "gl")
AXIOM_TEXT = {
    "axiom1_full": "Axiom 1: writes only where the reader reads → 1",
    "axiom2_zero": "Axiom 2: orthogonal write/read spaces → 0",
    "axiom3_monotone_smooth": "Axiom 3: rotating the write space in raises it monotonically, smoothly",
    "axiom4_invariant": "Axiom 4: unchanged by any change of residual basis",
}
PROCESSING_TEXT = {
    "none": "raw weights",
    "compat": "LayerNorm/RMSNorm folded into the weights, writing weights centred",
}
GAUSS_LABEL = "Gaussian null (random factors)"
SPECTRUM_LABEL = "spectrum-kept null (same singular values, random singular vectors)"

MODEL_COLUMNS = (
    ("model", "model"),
    ("checkpoint", "checkpoint"),
    ("architecture", "architecture"),
    ("n_layers", "layers"),
    ("n_heads", "heads"),
    ("n_kv_heads", "KV heads"),
    ("d_model", "d_model"),
    ("d_head", "d_head"),
    ("d_vocab", "vocab"),
    ("norm_type", "norm"),
    ("processing", "processing"),
    ("quantized", "quantized"),
    ("source_kind", "source"),
)
COMPOSITION_COLUMNS = (
    "comp", "space", "metric", "processing", "writer_layer", "writer_head", "reader_layer",
    "reader_head", "score", "baseline_gaussian_mean", "baseline_gaussian_std",
    "baseline_spectrum_mean", "baseline_spectrum_std",
)  # fmt: skip

HEATMAP_PANEL_MAX = 420  # px, side of one Q/K/V panel for big models
HIST_BINS = 40
TOP_N = 10
Z_STRONG = 3.0


# ----------------------------------------------------------------------------- helpers


def _order(values: Iterable[str], preferred: tuple[str, ...]) -> list[str]:
    vals = set(values)
    return [v for v in preferred if v in vals] + sorted(vals - set(preferred))


def safe_name(s: str) -> str:
    """A file-name-safe version of a model / checkpoint / metric / space name."""
    return re.sub(r"[^A-Za-z0-9._+-]", "-", str(s)) or "-"


def figure_stem(model: str, checkpoint: str, metric: str, space: str) -> str:
    return "__".join(safe_name(x) for x in (model, checkpoint, metric, space))


def _head_label(layer: int, head: int) -> str:
    return f"L{layer}.H{head}"


def _fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        return f"{v:.{digits}g}" if abs(v) < 1e-3 and v != 0 else f"{v:.{digits}f}"
    return str(v)


def _esc(v: Any) -> str:
    return html.escape(_fmt(v))


def _table(header: list[str], rows: list[list[Any]], cls: str = "") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _finite(x: Any) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


# ----------------------------------------------------------------------------- data access


def _view_exists(con: duckdb.DuckDBPyConnection, name: str) -> bool:
    try:
        con.execute(f"SELECT * FROM {name} LIMIT 0")
        return True
    except duckdb.Error:
        return False


def _load_models(con: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    if not _view_exists(con, "models"):
        return pl.DataFrame({c: [] for c, _ in MODEL_COLUMNS}, schema={c: pl.Utf8 for c, _ in MODEL_COLUMNS})
    df = con.sql("SELECT * FROM models").pl()
    for c, _ in MODEL_COLUMNS:
        if c not in df.columns:
            df = df.with_columns(pl.lit(None).alias(c))
    return df.select([c for c, _ in MODEL_COLUMNS]).sort(["model", "checkpoint"], nulls_last=True)


def _load_keys(con: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    if not _view_exists(con, "composition"):
        return pl.DataFrame(schema={"model": pl.Utf8, "checkpoint": pl.Utf8})
    return con.sql("SELECT DISTINCT model, checkpoint FROM composition ORDER BY model, checkpoint").pl()


def _load_pairs(con: duckdb.DuckDBPyConnection, model: str, checkpoint: str) -> pl.DataFrame:
    cols = ", ".join(COMPOSITION_COLUMNS)
    return con.sql(
        f"SELECT {cols} FROM composition WHERE model = ? AND checkpoint IS NOT DISTINCT FROM ?",
        params=[model, checkpoint],
    ).pl()


# ----------------------------------------------------------------------------- figures


def _geometry(df: pl.DataFrame, n_heads_hint: Any) -> int:
    """Heads per layer: the models table's n_heads, or what the data shows if larger."""
    seen = int(max(df["writer_head"].max(), df["reader_head"].max())) + 1
    hint = int(n_heads_hint) if _finite(n_heads_hint) else 0
    return max(seen, hint, 1)


def _layer_axis(title: str, start_layer: int, stop_layer: int, H: int, x: bool) -> alt.Axis:
    """Ticks (and thin white grid lines) at the first head of each layer, labelled "L{layer}"."""
    return alt.Axis(
        title=title,
        values=[layer * H for layer in range(start_layer, stop_layer)],
        labelExpr=f"'L' + round(datum.value / {H})",
        grid=True,
        gridColor="white",
        gridWidth=0.6,
        gridOpacity=0.9,
        zindex=1,
        ticks=False,
        labelPadding=3,
        labelFontSize=10,
        titleFontSize=12,
        labelAlign="left" if x else "right",
        labelBaseline="middle" if x else "top",
        labelAngle=0,
        labelOverlap=True,
        labelFlush=False,
    )


HEATMAP_DATA = "heatmap"  # name of the heatmap's dataset in the spec's top-level "datasets"


def _head_indices(df: pl.DataFrame, H: int) -> pl.DataFrame:
    return df.with_columns(
        w=pl.col("writer_layer") * H + pl.col("writer_head"),
        r=pl.col("reader_layer") * H + pl.col("reader_head"),
        s=pl.when(pl.col("score").is_finite()).then(pl.col("score").round(4)),
    )


def heatmap_rows(df: pl.DataFrame, H: int) -> list[dict[str, Any]]:
    """The heatmap's data, compact: one row per (comp, writer head index ``w`` = layer * H + head)
    with the scores (4 decimals, null where missing) of reader heads ``r0``, ``r0 + 1``, ..."""
    rows: list[dict[str, Any]] = []
    d = _head_indices(df, H)
    for (comp, w), g in d.sort(["comp", "w", "r"]).group_by(["comp", "w"], maintain_order=True):
        r = g["r"].to_list()
        r0 = r[0]
        arr: list[float | None] = [None] * (r[-1] - r0 + 1)
        for ri, si in zip(r, g["s"].to_list()):
            arr[ri - r0] = si
        rows.append({"c": comp, "w": int(w), "r0": int(r0), "s": arr})
    return rows


def heatmap_chart(df: pl.DataFrame, model: str, checkpoint: str, metric: str, space: str,
                  H: int, processing: str | None = None) -> alt.FacetChart:
    """Q/K/V panels of writer head (rows) x reader head (columns), colour = score.

    ``df``: rows of one model x checkpoint x metric x space (any comps). The chart reads the
    named dataset ``HEATMAP_DATA``: supply ``heatmap_rows(df, H)`` as the spec's top-level
    ``datasets`` (``_Page.figure`` does), so that Altair never walks ~10^5 values."""
    d = _head_indices(df, H)

    w_lo, w_hi = int(d["writer_layer"].min()), int(d["writer_layer"].max()) + 1
    r_lo, r_hi = int(d["reader_layer"].min()), int(d["reader_layer"].max()) + 1
    n_w, n_r = (w_hi - w_lo) * H, (r_hi - r_lo) * H
    side = max(180, min(HEATMAP_PANEL_MAX, 14 * max(n_w, n_r)))
    width = max(120, round(side * n_r / max(n_w, n_r)))
    height = max(120, round(side * n_w / max(n_w, n_r)))
    smax = d["s"].max()
    cmax = float(smax) if _finite(smax) and smax > 0 else 1.0
    cmax = math.ceil(cmax * 100) / 100

    formula, words = METRIC_TEXT.get(metric, (metric, ""))
    comps = _order(d["comp"].unique().to_list(), COMPS)
    subtitle = [
        f"score = {formula}" + (f": {words}." if words else "."),
        "L = writer head's OV matrix (W_V W_O); R = reader's matrix: Q: W_Q W_K^T, K: W_K W_Q^T, V: W_V W_O.",
        "Rows: writer head; columns: reader head in a later layer (ticks = first head of each layer). "
        "Hover a cell for its heads.",
        f"Space: {space}" + (f" ({SPACE_TEXT[space]})" if space in SPACE_TEXT else "") + ".",
    ]
    if processing:
        subtitle.append(f"Processing: {processing}"
                        + (f" ({PROCESSING_TEXT[processing]})" if processing in PROCESSING_TEXT else "") + ".")
    base = (
        alt.Chart(alt.Data(name=HEATMAP_DATA))
        .transform_flatten(["s"])
        .transform_window(i="row_number()", groupby=["c", "w"])
        .transform_filter("isValid(datum.s)")
        .transform_calculate(
            r=f"datum.r0 + datum.i - 1",
        )
        .transform_calculate(
            w1="datum.w + 1",
            r1="datum.r + 1",
            writer=f"'L' + floor(datum.w / {H}) + '.H' + (datum.w % {H})",
            reader=f"'L' + floor(datum.r / {H}) + '.H' + (datum.r % {H})",
        )
        .mark_rect(strokeWidth=0)
        .encode(
            x=alt.X("r:Q", scale=alt.Scale(domain=[r_lo * H, r_hi * H], nice=False, zero=False),
                    axis=_layer_axis("reader head (by layer, then head)", r_lo, r_hi, H, x=True)),
            x2="r1:Q",
            y=alt.Y("w:Q", scale=alt.Scale(domain=[w_lo * H, w_hi * H], nice=False, zero=False, reverse=True),
                    axis=_layer_axis("writer head (by layer, then head)", w_lo, w_hi, H, x=False)),
            y2="w1:Q",
            color=alt.Color("s:Q", title=f"{metric} score",
                            scale=alt.Scale(scheme="viridis", domain=[0, cmax], clamp=True),
                            legend=alt.Legend(gradientLength=min(height, 200), titleFontSize=11)),
            tooltip=[
                alt.Tooltip("writer:N", title="writer"),
                alt.Tooltip("reader:N", title="reader"),
                alt.Tooltip("s:Q", title="score", format=".4f"),
            ],
        )
        .properties(width=width, height=height)
    )
    return _facet_by_comp(base, comps, 18, f"{model} @ {checkpoint}: {metric} composition, {space} space",
                          subtitle).configure_view(stroke="#999", fill="#f4f4f4")


def _facet_by_comp(chart, comps: list[str], spacing: int, title: str, subtitle: list[str]) -> alt.FacetChart:
    """One panel per comp, headed 'Q-composition' etc., under a titled figure."""
    return chart.facet(
        column=alt.Column("c:N", sort=comps, title=None,
                          header=alt.Header(labelExpr="datum.value + '-composition'",
                                            labelFontSize=13, labelFontWeight="bold")),
        spacing=spacing,
    ).properties(
        title=alt.TitleParams(text=title, subtitle=subtitle, anchor="start", fontSize=15, subtitleFontSize=11,
                              subtitleColor="#444"),
        padding=12,
    )


def _bins(df: pl.DataFrame) -> tuple[float, float]:
    vals = [df[c].max() for c in ("score", "baseline_gaussian_mean", "baseline_spectrum_mean")]
    hi = max([float(v) for v in vals if _finite(v)] + [0.0])
    lo = df["score"].min()
    lo = min(0.0, float(lo)) if _finite(lo) else 0.0
    if hi <= lo:
        hi = lo + 1.0
    return lo, hi + (hi - lo) * 0.02


def _col_mean(g: pl.DataFrame, col: str) -> float | None:
    v = g.filter(pl.col(col).is_finite())[col].mean()
    return float(v) if _finite(v) else None


def distribution_chart(df: pl.DataFrame, model: str, checkpoint: str, metric: str, space: str) -> alt.FacetChart:
    """Histogram of the scores per comp with the mean of both null baselines as rules."""
    lo, hi = _bins(df)
    edges = np.linspace(lo, hi, HIST_BINS + 1)
    rows: list[dict[str, Any]] = []
    comps = _order(df["comp"].unique().to_list(), COMPS)
    for comp in comps:
        g = df.filter(pl.col("comp") == comp)
        s = g.filter(pl.col("score").is_finite())["score"].to_numpy()
        counts, _ = np.histogram(s, bins=edges)
        for i, n in enumerate(counts):
            rows.append({"c": comp, "k": "bin", "x0": round(float(edges[i]), 5),
                         "x1": round(float(edges[i + 1]), 5), "n": int(n)})
        for label, col in ((GAUSS_LABEL, "baseline_gaussian_mean"), (SPECTRUM_LABEL, "baseline_spectrum_mean")):
            m = _col_mean(g, col)
            if m is not None:
                rows.append({"c": comp, "k": "rule", "null": label, "x": round(m, 5)})

    xscale = alt.Scale(domain=[lo, hi], nice=False, zero=False)
    bars = (
        alt.Chart()
        .transform_filter("datum.k == 'bin'")
        .mark_rect(color="#4c78a8", opacity=0.85, stroke="white", strokeWidth=0.3)
        .encode(
            x=alt.X("x0:Q", scale=xscale, title=f"{metric} score"),
            x2="x1:Q",
            y=alt.Y("n:Q", title="number of head pairs", axis=alt.Axis(tickMinStep=1, format="d")),
            tooltip=[alt.Tooltip("x0:Q", title="from", format=".4f"),
                     alt.Tooltip("x1:Q", title="to", format=".4f"),
                     alt.Tooltip("n:Q", title="pairs")],
        )
    )
    legend_title = "mean of the null baseline (over all pairs)"
    legend = alt.Legend(orient="bottom", direction="vertical", labelLimit=0, titleLimit=0,
                        labelFontSize=11, symbolStrokeWidth=3)
    rules = (
        alt.Chart()
        .transform_filter("datum.k == 'rule'")
        .mark_rule(strokeWidth=2.5)
        .encode(
            x=alt.X("x:Q", scale=xscale),
            color=alt.Color("null:N", title=legend_title,
                            scale=alt.Scale(domain=[GAUSS_LABEL, SPECTRUM_LABEL], range=["#e6550d", "#d62790"]),
                            legend=legend),
            strokeDash=alt.StrokeDash("null:N", title=legend_title,
                                      scale=alt.Scale(domain=[GAUSS_LABEL, SPECTRUM_LABEL], range=[[6, 3], [1, 0]]),
                                      legend=legend),
            tooltip=[alt.Tooltip("null:N", title="baseline"), alt.Tooltip("x:Q", title="mean", format=".4f")],
        )
    )
    return _facet_by_comp(
        alt.layer(bars, rules, data=alt.Data(values=rows)).properties(width=260, height=170), comps, 16,
        f"{model} @ {checkpoint}: distribution of {metric} scores, {space} space",
        ["All writer/reader head pairs (writer layer < reader layer). Vertical lines: what the score",
         "would be on average if the weights had no structure, under two null models."])


# ----------------------------------------------------------------------------- tables


def _zscores(df: pl.DataFrame) -> pl.DataFrame:
    return df.filter(
        pl.col("score").is_finite() & pl.col("baseline_spectrum_mean").is_finite()
        & pl.col("baseline_spectrum_std").is_finite() & (pl.col("baseline_spectrum_std") > 0)
    ).with_columns(z=(pl.col("score") - pl.col("baseline_spectrum_mean")) / pl.col("baseline_spectrum_std"))


def summary_table(df: pl.DataFrame) -> str:
    zdf = _zscores(df)
    rows = []
    for comp in _order(df["comp"].unique().to_list(), COMPS):
        g = df.filter(pl.col("comp") == comp)
        zg = zdf.filter(pl.col("comp") == comp)
        n_strong = int((zg["z"] > Z_STRONG).sum()) if zg.height else None
        rows.append([
            f"{comp}-composition", g.height, _col_mean(g, "score"), _col_mean(g, "baseline_gaussian_mean"),
            _col_mean(g, "baseline_spectrum_mean"),
            "–" if n_strong is None else f"{n_strong} ({100 * n_strong / max(zg.height, 1):.1f}%)",
        ])
    return _table(["", "head pairs", "mean score", "mean Gaussian null", "mean spectrum-kept null",
                   f"pairs with z > {Z_STRONG:g}"], rows, cls="summary")


def top_pairs_tables(df: pl.DataFrame) -> str:
    zdf = _zscores(df)
    if zdf.height == 0:
        return "<p class='note'>No z-scores: the spectrum-kept baseline has no spread for these pairs.</p>"
    parts = []
    for comp in _order(zdf["comp"].unique().to_list(), COMPS):
        top = zdf.filter(pl.col("comp") == comp).sort("z", descending=True).head(TOP_N)
        rows = [
            [_head_label(r["writer_layer"], r["writer_head"]), _head_label(r["reader_layer"], r["reader_head"]),
             r["score"], f"{_fmt(r['baseline_spectrum_mean'])} ± {_fmt(r['baseline_spectrum_std'])}",
             f"{r['z']:.1f}"]
            for r in top.iter_rows(named=True)
        ]
        parts.append(f"<div><h5>{comp}-composition</h5>"
                     + _table(["writer", "reader", "score", "spectrum-kept null", "z"], rows, cls="top") + "</div>")
    return ("<p class='note'>Top pairs by z = (score − spectrum-kept null mean) / spectrum-kept null std, "
            "i.e. how far a pair's composition stands above what its heads' singular values alone "
            "would give.</p><div class='tops'>" + "".join(parts) + "</div>")


def models_table(models: pl.DataFrame) -> str:
    rows = []
    for r in models.iter_rows(named=True):
        rows.append([r[c] for c, _ in MODEL_COLUMNS])
    return _table([h for _, h in MODEL_COLUMNS], rows, cls="models")


# ----------------------------------------------------------------------------- page


CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 1.5em 2em; color: #222; max-width: 1600px; }
h1 { margin-bottom: 0.2em; } h2 { border-top: 2px solid #ccc; padding-top: 0.6em; margin-top: 2em; }
h4 { margin: 1.4em 0 0.4em; } h5 { margin: 0.5em 0 0.2em; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.4em 0; }
th, td { border: 1px solid #ddd; padding: 2px 7px; text-align: right; }
th { background: #f0f0f0; } td:first-child, th:first-child { text-align: left; }
.note { color: #555; font-size: 0.9em; max-width: 70em; }
.tops { display: flex; gap: 1.5em; flex-wrap: wrap; }
.fig { overflow-x: auto; min-height: 120px; }
.side { display: flex; flex-wrap: wrap; gap: 12px; align-items: flex-start; }
.pass { color: #1a7f37; font-weight: bold; } .fail { color: #cf222e; font-weight: bold; }
table.audit td { vertical-align: top; max-width: 260px; }
.png { font-size: 0.8em; }
nav ul { columns: 3; font-size: 0.9em; }
"""

JS_EMBED = """(() => {
const opts = {renderer: "canvas", actions: {export: true, source: false, compiled: false, editor: false}};
function show(el) {
  if (el.dataset.done) return; el.dataset.done = "1";
  const spec = JSON.parse(document.getElementById(el.dataset.spec).textContent);
  vegaEmbed(el, spec, opts).catch(e => { el.textContent = "Could not draw this figure: " + e; });
}
const figs = document.querySelectorAll("div.fig[data-spec]");
if ("IntersectionObserver" in window) {
  const io = new IntersectionObserver(es => es.forEach(e => { if (e.isIntersecting) { io.unobserve(e.target); show(e.target); } }),
                                      {rootMargin: "800px"});
  figs.forEach(f => io.observe(f));
} else { figs.forEach(show); }
})();
"""


def _spec_json(chart: alt.TopLevelMixin, datasets: dict[str, list[dict[str, Any]]] | None = None) -> str:
    """The Vega-Lite spec as JSON, with ``datasets`` added to its top-level datasets."""
    spec = chart.to_dict()
    if datasets:
        spec.setdefault("datasets", {}).update(datasets)
    # '<' escaped so no spec text can close the <script> element it sits in.
    return json.dumps(spec, separators=(",", ":")).replace("<", "\\u003c")


def _js_bundle() -> str:
    import vl_convert as vlc

    try:
        from altair.utils._importers import vl_version_for_vl_convert

        return vlc.javascript_bundle(vl_version=vl_version_for_vl_convert())
    except ImportError:  # pragma: no cover - altair internals moved
        return vlc.javascript_bundle()


def _png(spec_json: str) -> bytes:
    import vl_convert as vlc

    return vlc.vegalite_to_png(spec_json, scale=1)


class _Page:
    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self.parts: list[str] = []
        self.written: list[Path] = []
        self.n_specs = 0

    def add(self, s: str) -> None:
        self.parts.append(s)

    def figure(self, chart: alt.TopLevelMixin, png_name: str,
               datasets: dict[str, list[dict[str, Any]]] | None = None) -> None:
        spec = _spec_json(chart, datasets)
        path = self.out_dir / png_name
        with atomic_path(path) as tmp:
            tmp.write_bytes(_png(spec))
        self.written.append(path)
        sid = f"spec{self.n_specs}"
        self.n_specs += 1
        self.add(f'<script type="application/json" id="{sid}">{spec}</script>'
                 f'<div class="fig" data-spec="{sid}"></div>'
                 f'<div class="png"><a href="{html.escape(png_name)}">PNG</a></div>')


def _model_intro(minfo: dict[str, Any] | None) -> str:
    if minfo is None:
        return "<p class='note'>This model has composition results but no row in the models table.</p>"
    bits = [f"{_esc(minfo['architecture'])}", f"{_esc(minfo['n_layers'])} layers",
            f"{_esc(minfo['n_heads'])} heads per layer", f"{_esc(minfo['n_kv_heads'])} KV heads",
            f"d_model {_esc(minfo['d_model'])}", f"d_head {_esc(minfo['d_head'])}",
            f"vocabulary {_esc(minfo['d_vocab'])}", f"norm {_esc(minfo['norm_type'])}",
            f"processing {_esc(minfo['processing'])}"]
    s = "<p>" + ", ".join(bits) + ".</p>"
    if minfo.get("quantized") is True:
        s += ("<p class='note'><b>Quantized weights:</b> their singular values include quantization "
              "noise, which shifts svd_bound scores and the spectrum-kept null.</p>")
    return s


def _section(page: _Page, con: duckdb.DuckDBPyConnection, model: str, checkpoint: str,
             minfo: dict[str, Any] | None, has_results: bool) -> None:
    page.add(f"<h3 id='{html.escape(safe_name(model) + '__' + safe_name(checkpoint))}'>"
             f"checkpoint {html.escape(str(checkpoint))}</h3>")
    page.add(_model_intro(minfo))
    if not has_results:
        n_layers = minfo.get("n_layers") if minfo else None
        if _finite(n_layers) and n_layers < 2:
            page.add("<p class='note'>No head pairs: with a single layer there is no writer head in an "
                     "earlier layer than a reader head.</p>")
        else:
            page.add("<p class='note'>No composition results for this model and checkpoint yet.</p>")
        return
    df = _load_pairs(con, model, checkpoint)
    H = _geometry(df, minfo.get("n_heads") if minfo else None)
    processing = (minfo or {}).get("processing")
    if processing is None and df["processing"].drop_nulls().len():
        processing = df["processing"].drop_nulls()[0]
    invariance_figure(page, con, model, checkpoint)
    behaviour_section(page, con, model, checkpoint)
    for metric in _order(df["metric"].unique().to_list(), METRIC_ORDER):
        formula, words = METRIC_TEXT.get(metric, (metric, ""))
        page.add(f"<h4>{html.escape(metric)}</h4><p class='note'>score = <code>{html.escape(formula)}</code>"
                 + (f": {html.escape(words)}." if words else ".") + " Spaces side by side: residual, then token.</p>")
        spaces = _order(df.filter(pl.col("metric") == metric)["space"].unique().to_list(), SPACE_ORDER)
        page.add("<div class='side'>")  # the same metric in every space, next to each other
        for space in spaces:
            g = df.filter((pl.col("space") == space) & (pl.col("metric") == metric))
            page.add("<div>")
            page.figure(heatmap_chart(g, model, checkpoint, metric, space, H, processing),
                        f"{figure_stem(model, checkpoint, metric, space)}__heatmap.png",
                        datasets={HEATMAP_DATA: heatmap_rows(g, H)})
            page.add("</div>")
        page.add("</div>")
        for space in spaces:
            g = df.filter((pl.col("space") == space) & (pl.col("metric") == metric))
            page.add(f"<h5>{html.escape(metric)} · {html.escape(space)} space: distribution and top pairs</h5>")
            page.figure(distribution_chart(g, model, checkpoint, metric, space),
                        f"{figure_stem(model, checkpoint, metric, space)}__distribution.png")
            page.add(summary_table(g))
            page.add(top_pairs_tables(g))


def invariance_figure(page: _Page, con: duckdb.DuckDBPyConnection, model: str, checkpoint: str) -> None:
    """Rank correlation with the untransformed scores, per transform class, metric and space."""
    if not _view_exists(con, "invariance"):
        return
    inv = con.sql("""SELECT transform, metric, space, min(spearman) AS spearman, max(max_abs_change) AS change,
                            min(top_k_overlap) AS top_k_overlap, any_value(top_k) AS k
                     FROM invariance WHERE model = ? AND checkpoint = ? GROUP BY ALL""",
                  params=[model, checkpoint]).pl()
    if inv.is_empty():
        return
    k = int(inv["k"][0])
    chart = alt.Chart(inv).mark_bar().encode(
        x=alt.X("transform:N", sort=list(TRANSFORM_ORDER), title="change of residual basis x → x T"),
        xOffset=alt.XOffset("space:N", sort=list(SPACE_ORDER)),
        y=alt.Y("spearman:Q", title="Spearman rank correlation with original scores (worst of Q/K/V)",
                scale=alt.Scale(domain=[min(0.0, float(inv["spearman"].min())), 1.0])),
        color=alt.Color("space:N", sort=list(SPACE_ORDER), title="space"),
        column=alt.Column("metric:N", sort=list(METRIC_ORDER), title=None),
        tooltip=["metric", "space", "transform", alt.Tooltip("spearman:Q", format=".4f"),
                 alt.Tooltip("change:Q", title="max |change|", format=".2e"),
                 alt.Tooltip("top_k_overlap:Q", title=f"top-{k} kept (worst)", format=".2f")],
    ).properties(width=260, height=200, title=alt.TitleParams(
        f"{model} @ {checkpoint}: which scores survive a change of basis?",
        subtitle=["Bars at 1: the ranking of head pairs is unchanged. Permutation, orthogonal and global "
                  "scale are symmetries every metric should survive;",
                  "diagonal scaling and general GL(n) are symmetries too (norms aside) — only token space survives them."]))
    page.add("<h4>Invariance audit (Axiom 4)</h4>")
    page.figure(chart, f"{safe_name(model)}__{safe_name(checkpoint)}__invariance.png")


def metric_audit_table(con: duckdb.DuckDBPyConnection) -> str:
    """Metrics (x space) as rows, axioms as columns: pass/fail with the measured values."""
    if not _view_exists(con, "metric_audit"):
        return ""
    df = con.sql("SELECT * FROM metric_audit").pl()
    if df.is_empty():
        return ""
    axioms = [a for a in AXIOM_TEXT if a in set(df["axiom"])]
    rows = []
    for metric in _order(df["metric"].unique().to_list(), METRIC_ORDER):
        for space in _order(df.filter(pl.col("metric") == metric)["space"].unique().to_list(), SPACE_ORDER):
            cells = [f"<b>{html.escape(metric)}</b>", html.escape(space)]
            for a in axioms:
                g = df.filter((pl.col("metric") == metric) & (pl.col("space") == space) & (pl.col("axiom") == a))
                ok = bool(g["passed"].all())
                vals = "; ".join(f"{c}: {v:.3g}" for c, v in zip(g["construction"], g["value"]) if v is not None)
                cells.append(f"<span class='{'pass' if ok else 'fail'}'>{'PASS' if ok else 'FAIL'}</span>"
                             f"<br><small>{html.escape(vals)}</small>")
            rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{html.escape(h)}</th>" for h in ["metric", "space", *[AXIOM_TEXT[a] for a in axioms]])
    return ("<h2 id='axioms'>Which metric satisfies which axiom?</h2><p class='note'>Canonical constructions "
            "(seeds 000, 002): identity with identity at d = 4, 16, 64; the rank-1 constant-rows/columns pair; "
            "a writer inside / orthogonal to the reader's subspace; a 21-step rotation of the write space into "
            "the read space (value = rise from orthogonal to aligned); a random model under every transform "
            "class (value = max change). Details: <code>SELECT * FROM metric_audit</code>.</p>"
            f"<table class='audit'><tr>{head}</tr>{''.join(rows)}</table>")


# ----------------------------------------------------------------------------- behaviour (induction)

HEAD_SCORE_TEXT = {
    "prev_token_mean": "previous-token score",
    "duplicate_mean": "duplicate-token score",
    "induction_mean": "induction score",
    "ablation_drop": "drop in induction strength when ablated",
}


def _rows(con: duckdb.DuckDBPyConnection, view: str, model: str, checkpoint: str) -> pl.DataFrame:
    if not _view_exists(con, view):
        return pl.DataFrame()
    return con.sql(f"SELECT * FROM {view} WHERE model = ? AND checkpoint = ?", params=[model, checkpoint]).pl()


def induction_charts(toks: pl.DataFrame, model: str, checkpoint: str) -> tuple[alt.TopLevelMixin, alt.TopLevelMixin]:
    """Histograms of A and B power (seed 004, result 1), and the strength of B against the
    nearby-B token and a random token on the same sequences (result 2), per filler setting."""
    toks = toks.with_columns(fillers=pl.format("{} + {} fillers", "filler_before", "filler_between"))
    hist = alt.Chart(toks).mark_bar(opacity=0.7).encode(
        x=alt.X("mean:Q", bin=alt.Bin(maxbins=30), title="induction strength (mean log-odds difference)"),
        y=alt.Y("count():Q", title="tokens", stack=None),
        color=alt.Color("role:N", title="power", sort=["A", "B"]),
        column=alt.Column("fillers:N", title=None),
    ).properties(width=300, height=180, title=alt.TitleParams(
        f"{model} @ {checkpoint}: A power and B power", subtitle=[
            "A power: mean strength over sequences with that token as A; B power: as B.",
            "Strength = logodds p(B | r.. A B r.. A) - logodds p(B | the same tokens shuffled, last kept)."]))
    long = pl.concat([
        toks.select("fillers", "role", pl.lit(label).alias("target"), pl.col(m).alias("mean"), pl.col(se).alias("se"))
        for label, m, se in (("B", "mean", "stderr"), ("nearby B*", "near_b_mean", "near_b_stderr"),
                             ("random R", "random_mean", "random_stderr"))])
    summary = long.group_by("fillers", "role", "target").agg(
        pl.col("mean").mean(), (pl.col("se").pow(2).sum().sqrt() / pl.len()).alias("se"))
    summary = summary.with_columns(lo=pl.col("mean") - 2 * pl.col("se"), hi=pl.col("mean") + 2 * pl.col("se"))
    order = ["B", "nearby B*", "random R"]
    base = alt.Chart(summary).encode(x=alt.X("target:N", sort=order, title=None))
    bars = base.mark_bar().encode(y=alt.Y("mean:Q", title="mean induction strength (± 2 s.e.)"),
                                  color=alt.Color("target:N", sort=order, legend=None))
    err = base.mark_errorbar().encode(y="lo:Q", y2="hi:Q")
    near = alt.layer(bars, err).properties(width=160, height=180).facet(
        column=alt.Column("fillers:N", title=None), row=alt.Row("role:N", title="sequences with fixed")).properties(
        title=alt.TitleParams(f"{model} @ {checkpoint}: is B's neighbourhood copied too?", subtitle=[
            "B* = the token nearest to B by cosine in W_U (W_E when tied); R = a random token. Same sequences."]))
    return hist, near


def top_tokens_tables(toks: pl.DataFrame, n: int = 10) -> str:
    """Top and bottom tokens (decoded) by A power and by B power, first filler setting."""
    first = toks.sort("filler_before", "filler_between").row(0, named=True)
    toks = toks.filter((pl.col("filler_before") == first["filler_before"])
                       & (pl.col("filler_between") == first["filler_between"]))
    parts = []
    for role in ("A", "B"):
        g = toks.filter(pl.col("role") == role)
        for label, frame in (("top", g.sort("mean", descending=True).head(n)), ("bottom", g.sort("mean").head(n))):
            rows = [[r["token_id"], repr(r["token_text"]), r["mean"], r["stderr"]] for r in frame.iter_rows(named=True)]
            parts.append(f"<div><b>{label} {n} by {role} power</b>"
                         + _table(["id", "token", f"{role} power", "s.e."], rows) + "</div>")
    return "<div class='side'>" + "".join(parts) + "</div>"


def head_scores_chart(heads: pl.DataFrame, model: str, checkpoint: str) -> alt.TopLevelMixin:
    """Layer x head heatmaps of each behavioural score (each with its own colour scale)."""
    charts = []
    for col, title in HEAD_SCORE_TEXT.items():
        scheme = "redblue" if col == "ablation_drop" else "viridis"
        charts.append(alt.Chart(heads).mark_rect().encode(
            x=alt.X("head:O", title="head"), y=alt.Y("layer:O", title="layer", sort="descending"),
            color=alt.Color(f"{col}:Q", title=None, scale=alt.Scale(scheme=scheme, reverse=col == "ablation_drop",
                                                                    **({"domainMid": 0} if col == "ablation_drop" else {}))),
            tooltip=["layer", "head", alt.Tooltip(f"{col}:Q", format=".3f")],
        ).properties(width=max(120, 12 * int(heads["head"].max() + 1)), height=max(120, 8 * int(heads["layer"].max() + 1)),
                     title=title))
    return alt.hconcat(*charts).resolve_scale(color="independent").properties(title=alt.TitleParams(
        f"{model} @ {checkpoint}: what each head does", subtitle=[
            "Attention scores on random tokens repeated twice: i -> i-1 (first half), i -> i-T (duplicate), "
            "i -> i-T+1 (induction)."]))


def composition_vs_behaviour_chart(best: pl.DataFrame, model: str, checkpoint: str) -> alt.TopLevelMixin:
    """Each reader head's strongest K-composition with a previous-token head against its induction score."""
    k = best.filter(pl.col("comp") == "K")
    return alt.Chart(k).mark_circle(size=40, opacity=0.7).encode(
        x=alt.X("best_score:Q", title="strongest K-composition with a previous-token head"),
        y=alt.Y("induction_mean:Q", title="induction score"),
        color=alt.Color("is_induction:N", title="induction head"),
        tooltip=["layer", "head", "best_writer", alt.Tooltip("best_score:Q", format=".3f"),
                 alt.Tooltip("induction_mean:Q", format=".3f"), alt.Tooltip("ablation_drop:Q", format=".3f")],
    ).properties(width=180, height=160).facet(
        row=alt.Row("metric:N", sort=list(METRIC_ORDER), title=None),
        column=alt.Column("space:N", sort=list(SPACE_ORDER), title=None)).resolve_scale(x="independent").properties(
        title=alt.TitleParams(f"{model} @ {checkpoint}: does composition predict induction?", subtitle=[
            "One point per reader head; previous-token heads are chosen by their behaviour (head_scores)."]))


def composition_vs_behaviour_table(cvb: pl.DataFrame) -> str:
    rows = [[r["metric"], r["space"], r["comp"], r["n_readers"], r["n_induction_heads"], r["auroc"],
             r["spearman_induction"], r["spearman_ablation"]]
            for r in cvb.sort("auroc", "spearman_induction", descending=True, nulls_last=True).iter_rows(named=True)]
    return _table(["metric", "space", "comp", "readers", "induction heads", "AUROC", "Spearman vs induction score",
                   "Spearman vs ablation drop"], rows)


def behaviour_section(page: _Page, con: duckdb.DuckDBPyConnection, model: str, checkpoint: str) -> None:
    toks = _rows(con, "induction_tokens", model, checkpoint)
    heads = _rows(con, "head_scores", model, checkpoint)
    if toks.is_empty() and heads.is_empty():
        return
    stem = f"{safe_name(model)}__{safe_name(checkpoint)}"
    page.add("<h4>Induction behaviour (forward passes)</h4>")
    if not toks.is_empty():
        hist, near = induction_charts(toks, model, checkpoint)
        page.figure(hist, f"{stem}__induction_powers.png")
        page.figure(near, f"{stem}__induction_near_b.png")
        page.add(top_tokens_tables(toks))
    if not heads.is_empty():
        page.figure(head_scores_chart(heads, model, checkpoint), f"{stem}__head_scores.png")
        best = _rows(con, "reader_best_composition", model, checkpoint)
        cvb = _rows(con, "composition_vs_behaviour", model, checkpoint)
        if not best.is_empty():
            page.figure(composition_vs_behaviour_chart(best, model, checkpoint), f"{stem}__composition_vs_behaviour.png")
            page.add("<p class='note'>AUROC: how well the reader's strongest composition with a previous-token head "
                     "separates induction heads (induction score above the threshold) from the rest; 0.5 is chance. "
                     "Empty when the model has no induction head.</p>")
            page.add(composition_vs_behaviour_table(cvb))


# ----------------------------------------------------------------------------- training (checkpoint series)


def _step_scale() -> alt.Scale:
    return alt.Scale(type="symlog")  # step 0 and log-spaced early checkpoints both visible


def _rule(formation: float | None) -> alt.Chart | None:
    if formation is None:
        return None
    return alt.Chart(pl.DataFrame({"step": [formation]})).mark_rule(color="black", strokeDash=[4, 3]).encode(x="step:Q")


def _with_rule(chart: alt.Chart, formation: float | None) -> alt.TopLevelMixin:
    rule = _rule(formation)
    return chart if rule is None else alt.layer(chart, rule)


@dataclass
class TrainingOutcome:
    """What the seed-000 analysis finds for one model with a checkpoint series."""
    heads: pl.DataFrame                 # head_scores at every checkpoint, with its step
    pair: tuple[tuple[int, int], tuple[int, int]] | None  # (induction head, previous-token head)
    formation: float | None             # formation step (formation.formation_step)
    drop: float | None                  # loss-drop step (formation.loss_drop_step)
    loss: pl.DataFrame                  # training loss per step (step, loss); empty without a training run
    curves: pl.DataFrame                # the pair's composition over training (metric, space, comp, step, score)

    @property
    def marker(self) -> float | None:
        """The step the curves are judged against: the formation, else the loss drop."""
        return self.formation if self.formation is not None else self.drop

    @cached_property
    def verdicts(self) -> pl.DataFrame | None:
        """formation.verdicts of the curves against the marker (computed once: the front page
        and the model's section both show them)."""
        from compatlas import formation as fm

        return None if self.marker is None or self.curves.is_empty() else fm.verdicts(self.curves, self.marker)


def training_outcome(con: duckdb.DuckDBPyConnection, model: str) -> TrainingOutcome | None:
    """The eventual heads, formation and loss-drop steps, and the eventual pair's composition
    curves of ``model``; None unless it has two or more checkpoints with steps and head scores."""
    from compatlas import formation as fm

    try:  # atlases built before checkpoint steps were recorded have no such column
        steps = con.sql("""SELECT checkpoint, checkpoint_step AS step FROM models
                           WHERE model = ? AND checkpoint_step IS NOT NULL ORDER BY step""", params=[model]).pl()
    except duckdb.Error:
        return None
    if steps.height < 2 or not _view_exists(con, "head_scores"):
        return None
    heads = con.sql("""SELECT h.*, m.checkpoint_step AS step FROM head_scores h JOIN models m USING (model, checkpoint)
                       WHERE h.model = ? AND m.checkpoint_step IS NOT NULL ORDER BY step""", params=[model]).pl()
    if heads.is_empty():
        return None
    loss = (con.sql("SELECT step, loss FROM training_loss WHERE model = ? ORDER BY step", params=[model]).pl()
            if _view_exists(con, "training_loss") else pl.DataFrame(schema={"step": pl.Int64, "loss": pl.Float64}))
    drop = fm.loss_drop_step(loss["step"].to_numpy(), loss["loss"].to_numpy()) if loss.height else None
    pair = fm.eventual_heads(heads.filter(pl.col("step") == heads["step"].max()))
    if pair is None:
        return TrainingOutcome(heads, None, None, drop, loss, pl.DataFrame())
    (il, ih), (pl_, ph) = pair
    ind = heads.filter((pl.col("layer") == il) & (pl.col("head") == ih)).sort("step")
    formation = fm.formation_step(ind["step"].to_numpy(), ind["induction_mean"].to_numpy())
    where = "model = ? AND writer_layer = ? AND writer_head = ? AND reader_layer = ? AND reader_head = ?"
    curves = con.sql(f"""SELECT c.metric, c.space, c.comp, m.checkpoint_step AS step, c.score
                         FROM composition c JOIN models m USING (model, checkpoint) WHERE c.{where.replace(' AND ', ' AND c.')}
                         ORDER BY step""", params=[model, pl_, ph, il, ih]).pl()
    return TrainingOutcome(heads, pair, formation, drop, loss, curves)


def _step(x: float | None) -> str:
    return "none" if x is None else f"{x:.0f}"


def training_runs_table(outcomes: dict[str, TrainingOutcome]) -> str:
    """Front page: one line per model with a checkpoint series."""
    from compatlas import formation as fm

    rows = []
    for model, t in outcomes.items():
        if t.pair is None:
            rows.append([model, "(one layer)", "", "", _step(t.drop), ""])
            continue
        (il, ih), (pl_, ph) = t.pair
        last = t.heads.filter(pl.col("step") == t.heads["step"].max())
        score = {(r["layer"], r["head"]): r for r in last.iter_rows(named=True)}
        tracks = "" if t.verdicts is None else ", ".join(
            f"{r['comp']} {r['metric']} ({r['space']})" for r in fm.tracking(t.verdicts).iter_rows(named=True))
        rows.append([model, f"{il}.{ih} ({score[(il, ih)]['induction_mean']:.2f})",
                     f"{pl_}.{ph} ({score[(pl_, ph)]['prev_token_mean']:.2f})",
                     _step(t.formation), _step(t.drop), tracks or "none"])
    return ("<h2 id='training'>Composition over training</h2><p class='note'>Per model with a checkpoint series: the "
            "eventual induction and previous-token heads (final scores), the formation step, the steepest loss drop, "
            "and the composition curves of the pair that track the formation without rising early (details in the "
            "model's section).</p>"
            + _table(["model", "induction head", "previous-token head", "formation step", "loss-drop step",
                      "tracks the formation"], rows))


def training_section(page: _Page, con: duckdb.DuckDBPyConnection, model: str, t: TrainingOutcome) -> None:
    """The seed-000 figure for a model with a checkpoint series (``training_outcome``): the
    eventual induction head and previous-token head, their composition over training in every
    metric and space, beside the loss, the head scores and the induction strength, with the
    formation step marked."""
    from compatlas import formation as fm

    stem = safe_name(model)
    page.add(f"<h3 id='{html.escape(stem)}__training'>{html.escape(model)}: composition over training</h3>")
    if t.pair is None:
        page.add("<p class='note'>A one-layer model: no head pairs to follow over training.</p>")
        return
    (il, ih), (pl_, ph) = t.pair
    heads, formation, drop, marker, curves = t.heads, t.formation, t.drop, t.marker, t.curves
    ind = heads.filter((pl.col("layer") == il) & (pl.col("head") == ih)).sort("step")
    prev = heads.filter((pl.col("layer") == pl_) & (pl.col("head") == ph)).sort("step")
    behaviour = pl.concat([
        ind.select("step", pl.lit(f"induction score of {il}.{ih}").alias("series"), pl.col("induction_mean").alias("value")),
        prev.select("step", pl.lit(f"previous-token score of {pl_}.{ph}").alias("series"), pl.col("prev_token_mean").alias("value"))])
    panels = [_with_rule(alt.Chart(behaviour).mark_line(point=True).encode(
        x=alt.X("step:Q", scale=_step_scale(), title="training step"), y=alt.Y("value:Q", title="attention score"),
        color=alt.Color("series:N", title=None, legend=alt.Legend(orient="bottom", columns=1))).properties(
        width=260, height=170, title="head scores"), marker)]
    if _view_exists(con, "induction_summary"):
        strength = con.sql("""SELECT m.checkpoint_step AS step, avg(s.mean_strength) AS strength
                              FROM induction_summary s JOIN models m USING (model, checkpoint)
                              WHERE s.model = ? GROUP BY ALL ORDER BY step""", params=[model]).pl()
        if not strength.is_empty():
            panels.append(_with_rule(alt.Chart(strength).mark_line(point=True, color="#c44e52").encode(
                x=alt.X("step:Q", scale=_step_scale(), title="training step"),
                y=alt.Y("strength:Q", title="mean induction strength")).properties(
                width=260, height=170, title="induction strength (seed 004)"), marker))
    if t.loss.height:
        width = max(1, t.loss.height // 200)  # bin to about 200 points
        loss = t.loss.with_columns(bin=(pl.col("step") - 1) // width).group_by("bin").agg(
            pl.col("step").max(), pl.col("loss").mean()).sort("step")
        panels.insert(0, _with_rule(alt.Chart(loss).mark_line(color="#555").encode(
            x=alt.X("step:Q", scale=_step_scale(), title="training step"), y=alt.Y("loss:Q", title="training loss")
        ).properties(width=260, height=170, title="loss"), marker))
    ribbon = con.sql("""SELECT c.metric, c.space, c.comp, m.checkpoint_step AS step,
                               quantile_cont(c.score, 0.1) AS q10, median(c.score) AS q50, quantile_cont(c.score, 0.9) AS q90
                        FROM composition c JOIN models m USING (model, checkpoint) WHERE c.model = ? GROUP BY ALL""",
                     params=[model]).pl()
    page.add(f"<p>Eventual induction head <b>{il}.{ih}</b> (highest induction score at the last checkpoint), eventual "
             f"previous-token head <b>{pl_}.{ph}</b> (highest previous-token score in an earlier layer). "
             + (f"Formation step <b>{formation:.0f}</b> (dashed): where {il}.{ih}'s induction score crosses the midpoint "
                f"of its first and final values."
                + (f" The training loss falls fastest at step <b>{drop:.0f}</b> (steepest fall of the smoothed loss)."
                   if drop is not None else "") if formation is not None else
                f"<b>No canonical induction head forms</b>: {il}.{ih}'s induction score (attention from i to i-T+1 on a "
                f"sequence repeated with period T) rises by less than {fm.MIN_RISE}; a head that attends to a shifted "
                "position (i-T+2, reading the target through a layer-0 head) does not count."
                + (f" The curves are judged against the loss-drop step <b>{drop:.0f}</b> (dashed; the steepest fall of "
                   "the smoothed training loss)." if drop is not None else "")) + "</p>")
    page.figure(alt.hconcat(*panels).properties(title=f"{model}: behaviour over training"), f"{stem}__training_behaviour.png")
    if curves.is_empty():
        return
    # layered charts with different data facet through a shared key: join both frames
    both = curves.with_columns(kind=pl.lit("pair")).join(ribbon, on=["metric", "space", "comp", "step"], how="left")
    grid = alt.layer(
        alt.Chart().mark_area(opacity=0.15).encode(x=alt.X("step:Q", scale=_step_scale(), title="training step"),
                                                   y=alt.Y("q10:Q", title=f"score of {pl_}.{ph} → {il}.{ih}"), y2="q90:Q",
                                                   color=alt.Color("comp:N", sort=list(COMPS), title="comp")),
        alt.Chart().mark_line(point=True).encode(x="step:Q", y="score:Q", color=alt.Color("comp:N", sort=list(COMPS)),
                                                 tooltip=["metric", "space", "comp", "step",
                                                          alt.Tooltip("score:Q", format=".3f")]),
        *([alt.Chart().mark_rule(color="black", strokeDash=[4, 3]).encode(x="marker:Q")] if marker is not None else []),
        data=both.with_columns(marker=pl.lit(marker)),
    ).properties(width=200, height=150).facet(
        row=alt.Row("metric:N", sort=list(METRIC_ORDER), title=None),
        column=alt.Column("space:N", sort=list(SPACE_ORDER), title=None)).resolve_scale(y="independent").properties(
        title=alt.TitleParams(f"{model}: composition of the eventual pair over training", subtitle=[
            "Lines: the eventual previous-token head writing into the eventual induction head; bands: 10-90% of all "
            "head pairs at that step (Q, K, V)."]))
    page.figure(grid, f"{stem}__training_composition.png")
    if t.verdicts is not None:
        v = t.verdicts
        page.add(f"<p><b>{html.escape(fm.statement(v))}</b></p>")
        page.add("<p class='note'>Tracks: ends above its value before the formation, with its largest rise between "
                 "consecutive checkpoints at (or next to) the formation step. Rises early: before half the formation "
                 "step (initialisation excluded) it already reaches its final value.</p>")
        page.add(_table(["metric", "space", "comp", "before formation", "final", "largest rise at step",
                         "early max", "tracks", "rises early"],
                        [[r["metric"], r["space"], r["comp"], r["before_formation"], r["final"], r["largest_rise_at"],
                          r["early_max"], r["tracks"], r["rises_early"]] for r in v.iter_rows(named=True)]))


def payoff_table(con: duckdb.DuckDBPyConnection) -> str:
    """Across models: which metric, in which space, finds the heads that really do induction."""
    if not _view_exists(con, "composition_vs_behaviour"):
        return ""
    df = con.sql("""SELECT metric, space, comp, count(*) AS models, avg(auroc) AS mean_auroc,
                           avg(spearman_induction) AS mean_spearman_induction,
                           avg(spearman_ablation) AS mean_spearman_ablation
                    FROM composition_vs_behaviour GROUP BY ALL
                    ORDER BY mean_auroc DESC NULLS LAST, mean_spearman_induction DESC NULLS LAST""").pl()
    if df.is_empty():
        return ""
    rows = [list(r) for r in df.iter_rows()]
    return ("<h2 id='payoff'>Which metric finds the induction heads?</h2><p class='note'>Per metric, space and "
            "comp, averaged over models and checkpoints (AUROC only over models with at least one induction head). "
            "Per model: <code>SELECT * FROM composition_vs_behaviour</code>.</p>"
            + _table(["metric", "space", "comp", "models", "mean AUROC", "mean Spearman (induction score)",
                      "mean Spearman (ablation drop)"], rows))


def build_report(db_path: str | Path, out_dir: str | Path) -> list[Path]:
    """Write ``out_dir/index.html`` and one PNG per figure from the atlas database.

    Opens ``db_path`` read-only and reads the ``composition`` and ``models`` views (plus the
    ``invariance`` and ``metric_audit`` views when they exist). Returns the files written
    (the PNGs, then ``index.html``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    page = _Page(out_dir)
    with alt.data_transformers.disable_max_rows():
        from compatlas.atlas import connect as atlas_connect

        con = atlas_connect(db_path)  # resolves the views' shard paths, relative to the atlas's folder
        try:
            models = _load_models(con)
            keys = _load_keys(con)
            minfo = {(r["model"], r["checkpoint"]): r for r in models.iter_rows(named=True)}
            with_results = {(r["model"], r["checkpoint"]) for r in keys.iter_rows(named=True)}
            all_keys = sorted(set(minfo) | with_results, key=lambda k: (str(k[0]), str(k[1])))

            page.add("<h1>compatlas: attention-head composition atlas</h1>")
            page.add("<p class='note'>How strongly each attention head (the <i>writer</i>) writes into what a "
                     "head of a later layer (the <i>reader</i>) reads, through its queries (Q-composition), "
                     "keys (K-composition) or values (V-composition). Each model has heatmaps of every "
                     "writer/reader pair per metric, and histograms of the scores against two null "
                     "baselines: a Gaussian null (random factors of the same shapes) and a spectrum-kept "
                     "null (same singular values, random singular vectors).</p>")
            if not all_keys:
                page.add("<p><b>No results:</b> the database has no models and no composition scores yet.</p>")
            else:
                page.add("<h2 id='models'>Models</h2>")
                page.add(models_table(models) if models.height else "<p class='note'>The models table is empty.</p>")
                page.add("<p class='note'>Quantized weights (quantized = true) carry quantization noise in their "
                         "spectra, which affects svd_bound scores and the spectrum-kept null.</p>")
                if not with_results:
                    page.add("<p><b>No results:</b> there are no composition scores yet.</p>")
                page.add(metric_audit_table(con))
                page.add(payoff_table(con))
                outcomes = {m: t for m in dict.fromkeys(k[0] for k in all_keys)
                            if (t := training_outcome(con, str(m))) is not None}
                if outcomes:
                    page.add(training_runs_table(outcomes))
                page.add("<nav><ul>" + "".join(
                    f"<li><a href='#{html.escape(safe_name(m) + '__' + safe_name(c))}'>{html.escape(str(m))} @ "
                    f"{html.escape(str(c))}</a></li>" for m, c in all_keys) + "</ul></nav>")
                current = None
                for model, checkpoint in all_keys:
                    if model != current:
                        page.add(f"<h2>{html.escape(str(model))}</h2>")
                        if model in outcomes:
                            training_section(page, con, model, outcomes[model])
                        current = model
                    _section(page, con, model, checkpoint, minfo.get((model, checkpoint)),
                             (model, checkpoint) in with_results)
        finally:
            con.close()

    doc = ("<!DOCTYPE html>\n<html lang='en'><head><meta charset='UTF-8'>"
           "<title>compatlas report</title>"
           f"<style>{CSS}</style>"
           f"<script type='text/javascript'>\n{_js_bundle()}\n</script></head><body>\n"
           + "\n".join(page.parts)
           + f"\n<script type='text/javascript'>{JS_EMBED}</script>\n</body></html>\n")
    index = out_dir / "index.html"
    with atomic_path(index) as tmp:
        tmp.write_text(doc, encoding="utf-8")
    return [*page.written, index]
