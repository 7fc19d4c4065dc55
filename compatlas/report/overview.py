"""The overview page: one row per model, how each metric x space finds induction heads, figures
across models (relative depth on x), the training runs, the metric audit, and the footer."""

from __future__ import annotations

import html
import json
from datetime import UTC, datetime
from importlib import metadata
from typing import Any

import altair as alt
import polars as pl

from compatlas.report.circuit import DISCOVERY
from compatlas.report.findings import why_none
from compatlas.report.model import ModelData
from compatlas.report.page import fmt, head, table
from compatlas.tables import integer
from compatlas.vocab import COMPS, METRICS, NORMALISED_METRICS, SPACES


def _link(d: ModelData) -> str:
    return f"<a href='{html.escape(d.page)}'>{html.escape(d.model)}</a>"


def _heads(df: pl.DataFrame, col: str, n: int = 3) -> str:
    if df.is_empty():
        return "none"
    s = ", ".join(f"{head(r['layer'], r['head'])} ({r[col]:.2f})" for r in df.head(n).iter_rows(named=True))
    return s + (f" +{df.height - n} more" if df.height > n else "")


def _circuit_elsewhere(d: ModelData) -> str:
    return (f"; its circuit: <a href='{html.escape(d.page)}#behaviour'>head scores</a>"
            + (f" and <a href='{html.escape(d.page)}#training'>composition over training</a>" if d.outcome else ""))


def runs(heads: list[int]) -> str:
    """Head numbers as runs: [3, 4, 5, 7] -> "H3–5, H7"."""
    out: list[list[int]] = []
    for h in sorted(set(heads)):
        if out and h == out[-1][-1] + 1:
            out[-1].append(h)
        else:
            out.append([h])
    return ", ".join(f"H{r[0]}" + (f"–{r[-1]}" if len(r) > 1 else "") for r in out)


def compact_circuit(edges: pl.DataFrame, writers_max: int = 3) -> str:
    """K-circuit edges (writer -> reader rows) in a line: per writer, most edges first, its readers
    by layer with runs of heads: "L16.H0 → L17.H3–5, L18.H6–7; L22.H1 → L23.H2, H7"; past
    ``writers_max`` writers, how many edges are left out."""
    if edges.is_empty():
        return ""
    by = (edges.group_by("writer_layer", "writer_head").agg(pl.len().alias("n"))
          .sort(["n", "writer_layer", "writer_head"], descending=[True, False, False]))
    parts = []
    for w in by.head(writers_max).iter_rows(named=True):
        mine = edges.filter((pl.col("writer_layer") == w["writer_layer"]) & (pl.col("writer_head") == w["writer_head"]))
        readers = ", ".join(f"L{layer}.{runs(g['reader_head'].to_list())}"
                            for (layer,), g in mine.sort("reader_layer").group_by("reader_layer", maintain_order=True))
        parts.append(f"{head(w['writer_layer'], w['writer_head'])} → {readers}")
    left = int(by["n"].sum()) - int(by.head(writers_max)["n"].sum())
    return "; ".join(parts) + (f"; +{left} more" if left else "")


def _strongest(d: ModelData, q_cut: float | None = None) -> str:
    """Per comp, the lead metric x space's number of discoveries and its strongest one, and the K
    circuit there (K discoveries from a previous-token head into an induction head) where it has
    one; then every metric x space's discoveries per comp (what the ``discoveries`` view holds: a
    random model's one false discovery in another cell read "Q 0 K 0 V 0" when only the lead was
    counted) and how many false ones the false discovery rate allows (``false_line``); or why the
    model can have none (``findings.why_none``) and where its circuit shows instead."""
    if d.lead is None:
        return "no pairs"
    if (why := why_none(d.summary, q_cut)) is not None:
        return f"<small>{html.escape(why)}{_circuit_elsewhere(d)}</small>"
    summ = d.summary.filter((pl.col("metric") == d.lead[0]) & (pl.col("space") == d.lead[1]))
    n = {r["comp"]: r["discoveries"] for r in summ.iter_rows(named=True)}
    e = d.edges.filter((pl.col("metric") == d.lead[0]) & (pl.col("space") == d.lead[1])) if d.edges.height else d.edges
    if "kind" in e.columns:
        e = e.filter(pl.col("kind") == DISCOVERY)
    out = []
    for comp in COMPS:
        if comp not in n:
            continue
        g = e.filter(pl.col("comp") == comp).sort(["q_value", "score"], descending=[False, True]) if e.height else e
        best = "" if g.is_empty() or d.candidates else (f": {head(g['writer_layer'][0], g['writer_head'][0])} → "
                                        f"{head(g['reader_layer'][0], g['reader_head'][0])} (q {fmt(g['q_value'][0])})")
        out.append(html.escape(f"{comp} {fmt(n[comp])}{best}"))
    where = f"{html.escape(d.lead[0])}, {html.escape(d.lead[1])}"
    circ = d.circuit.filter((pl.col("metric") == d.lead[0]) & (pl.col("space") == d.lead[1])) if d.circuit.height else d.circuit
    if circ.height:
        out.append(f"<b>K circuit</b>: {html.escape(compact_circuit(circ))}")
    out.append(f"<small>({where} space: {html.escape(_why_lead(d))})</small>")
    if q_cut is not None and "discoveries" in d.summary.columns:
        out.append(f"<small>{html.escape(all_cells(d.summary))} {html.escape(false_line(d, q_cut))}</small>")
    return "<br>".join(out)


def all_cells(summary: pl.DataFrame) -> str:
    """Every metric x space's discoveries per comp, and where they are when they are in a few
    cells: "In all 16 metric · spaces: Q 1 (frobenius · token_norm), K 0, V 0."."""
    cells = summary.select("metric", "space").unique().height
    parts = []
    for comp in COMPS:
        g = summary.filter((pl.col("comp") == comp) & (pl.col("discoveries").fill_null(0) > 0))
        if comp not in set(summary["comp"]):
            continue
        total = int(g["discoveries"].sum()) if g.height else 0
        at = ", ".join(f"{r['metric']} · {r['space']}" + (f" {r['discoveries']:,}" if g.height > 1 else "")
                       for r in g.sort("metric", "space").iter_rows(named=True))
        parts.append(f"{comp} {total:,}" + (f" ({at})" if 0 < g.height <= 3 else f" (in {g.height} of them)" if g.height else ""))
    return f"In all {cells} metric · space{'s' if cells != 1 else ''}: {', '.join(parts)}."


def false_line(d: ModelData, q_cut: float) -> str:
    """How many false discoveries the false discovery rate allows. Benjamini-Hochberg at q <= FDR
    bounds the expected share of false discoveries among D by the FDR (about FDR x D of them);
    where no pair composes at all (a random-init model) every discovery is a false one, and in
    each family of tests (a metric x space x comp) the chance of any is at most the FDR, so over
    F families at most about F x FDR are expected to hold one."""
    total = int(d.summary["discoveries"].fill_null(0).sum())
    if d.info.get("source_kind") == "build":  # built from a shape with random weights: nothing composes
        fams = d.summary.height
        which = f"each of these {total:,} is" if total > 1 else "this one is" if total else "any would be"
        return (f"Random init: no pair composes, so {which} a false discovery; at q <= {q_cut:g} each of its {fams} "
                f"families (metric · space · comp) holds one with a chance of at most {q_cut:g}, so at most about "
                f"{fams} x {q_cut:g} = {fmt(fams * q_cut)} of them are expected to hold one by chance.")
    if not total:
        return ""
    return (f"At q <= {q_cut:g}, about {q_cut:g} x {total:,} = {fmt(q_cut * total)} of these {total:,} discoveries are "
            "expected to be false (the rate bounds their expected share).")


def _why_lead(d: ModelData) -> str:
    """Why the lead metric x space, in a few words (the rule: circuit.lead_cell)."""
    if d.circuit.height:
        return "the most K discoveries from a previous-token head into an induction head"
    return "no K discovery from a previous-token head into an induction head anywhere; the metric audit's lead"


def models_table(data: list[ModelData], cuts: tuple[float, float], q_cut: float | None = None) -> str:
    rows = []
    for d in data:
        i = d.info
        kv = f" / {i['n_kv_heads']} KV" if i.get("n_kv_heads") not in (None, i.get("n_heads")) else ""
        prev, ind = d.roles(*cuts)
        steps = d.checkpoints["checkpoint_step"].drop_nulls()
        ck = html.escape(d.latest) if d.checkpoints.height == 1 else (
            f"{d.checkpoints.height} (steps {fmt(integer(steps.min()))}–{fmt(integer(steps.max()))})" if len(steps)
            else str(d.checkpoints.height))
        src = html.escape(str(i.get("source_kind") or "–")) + (f"<br><small>{html.escape(str(i['source_name']))}</small>"
                                                                 if i.get("source_name") else "")
        rows.append([_link(d), html.escape(str(i.get("architecture") or "–")),
                     f"{fmt(i.get('n_layers'))} x {fmt(i.get('n_heads'))}{kv}", fmt(i.get("d_model")), src,
                     "yes" if i.get("quantized") else "no", ck,
                     html.escape(_heads(prev, "prev_token_mean")) if not d.heads.is_empty() else "–",
                     html.escape(_heads(ind, "induction_mean")) if not d.heads.is_empty() else "–", _strongest(d, q_cut)])
    return table(["model", "architecture", "layers x heads", "d_model", "source", "quantised", "checkpoints",
                  f"previous-token heads (score >= {cuts[0]:g})", f"induction heads (score >= {cuts[1]:g})",
                  "discoveries per comp: strongest"], rows, cls="models", raw=True)


def finds_table(data: list[ModelData], q_cut: float | None = None) -> str:
    """Per metric x space (a row) and model (a column): how K-composition with previous-token
    heads finds its induction heads; below, one line per model that can have no discoveries,
    saying why. Rows, not columns, per metric x space: 16 of them fit no page's width."""
    combos = [(m, s) for m in METRICS for s in SPACES if any((m, s) in d.combos for d in data)]
    shown: list[ModelData] = []
    notes: list[str] = []
    for d in data:
        link = f"<a href='{html.escape(d.page)}#behaviour'>{html.escape(d.model)}</a>"
        if combos and (why := why_none(d.summary, q_cut)) is not None:
            notes.append(f"<p><small>{link}: no recall or precision: discoveries {html.escape(why)}"
                         f"{_circuit_elsewhere(d)}</small></p>")
        else:
            shown.append(d)
    rows = []
    for m, s in combos:
        cells = [f"{html.escape(m)} · {html.escape(s)}"]
        for d in shown:
            k = d.cvb.filter(pl.col("comp") == "K") if not d.cvb.is_empty() else d.cvb
            g = k.filter((pl.col("metric") == m) & (pl.col("space") == s)) if k.height else k
            if g.is_empty():
                cells.append("–")
                continue
            r = g.row(0, named=True)
            n_ind, n = r["n_induction_heads"] or 0, r["n_readers"] or 0
            if n_ind == 0:
                cells.append("<small>no induction heads</small>")
                continue
            au = fmt(r["auroc"])  # NULL in the atlas below MIN_CLASS heads of a class
            if m not in NORMALISED_METRICS:  # a magnitude has no discoveries to count: its largest scores
                hits = _top_hits(d, m, s)
                cells.append(f"top-{n_ind} recall {fmt(None if hits is None else hits / n_ind)} <small>(a magnitude, no "
                             f"discoveries: {fmt(hits)} of the {n_ind} readers with the largest score from a "
                             f"previous-token head are induction heads; AUROC {au}; {n_ind} of {n})</small>")
                continue
            cells.append(f"recall {fmt(r.get('discovery_recall'))}, precision {fmt(r.get('discovery_precision'))}"
                         f" <small>(AUROC {au}; {n_ind} of {n})</small>")
        rows.append(cells)
    body = table(["metric · space", *[d.model for d in shown]], rows, cls="finds", raw=True) if shown else ""
    return body + "".join(notes)


def _top_hits(d: ModelData, metric: str, space: str) -> int | None:
    t = d.top_recall.filter((pl.col("metric") == metric) & (pl.col("space") == space)) if d.top_recall.height else d.top_recall
    return int(t["hits"][0]) if t.height else None


def recall_rows(d: ModelData) -> list[dict[str, Any]]:
    """The induction-circuit figure's rows of one model: per metric x space, the share of its
    induction heads with a K discovery from a previous-token head; for a magnitude metric, which
    has no discoveries, the share among its n readers with the largest such score (top-n recall)."""
    out = []
    for r in d.cvb.filter(pl.col("comp") == "K").iter_rows(named=True) if not d.cvb.is_empty() else []:
        if not r["n_induction_heads"]:
            continue
        magnitude = r["metric"] not in NORMALISED_METRICS
        hits = _top_hits(d, r["metric"], r["space"]) if magnitude else None
        rec = (None if hits is None else hits / r["n_induction_heads"]) if magnitude else r.get("discovery_recall")
        out.append({"model": d.model, "combo": f"{r['metric']} · {r['space']}", "recall": rec,
                    "precision": rec if magnitude else r.get("discovery_precision"), "induction_heads": r["n_induction_heads"],
                    "measure": "top-n (a magnitude: its largest scores)" if magnitude else "discoveries"})
    return out


def depth_chart(profile: pl.DataFrame) -> alt.FacetChart:
    """Where in depth the discoveries sit: share of the possible pairs into each reader layer.
    Only the model x comp lines with discoveries are drawn (lines flat at zero hid the others);
    the models without any are named in the subtitle."""
    found = profile.with_columns(total=pl.col("n").sum().over("model", "comp")).filter(pl.col("total") > 0)
    none = sorted(set(profile["model"]) - set(found["model"]))
    profile = found
    comps = [c for c in COMPS if c in set(profile["comp"])]
    return alt.Chart(profile).mark_line(point=True).encode(
        x=alt.X("depth:Q", title="reader layer / (layers - 1)", scale=alt.Scale(domain=[0, 1])),
        y=alt.Y("share:Q", title="share of pairs that are discoveries", axis=alt.Axis(format="%")),
        color=alt.Color("model:N", legend=alt.Legend(orient="bottom", columns=4, labelLimit=260)),
        tooltip=["model", "comp", "reader_layer", alt.Tooltip("share:Q", format=".1%"), "n"],
    ).properties(width=330, height=170).facet(column=alt.Column("comp:N", sort=comps, title=None, header=alt.Header(
        labelExpr="datum.value + '-composition'"))).properties(title=alt.TitleParams(
        "Where in depth each model's discoveries sit", anchor="start", subtitleColor="#444",
        subtitle=["Each model's lead metric x space at its last checkpoint: of the pairs writing into a reader layer, "
                  "the share with q at or below the false discovery rate; a comp without discoveries is left out."]
        + ([f"No discoveries, not drawn: {', '.join(none)}."] if none else [])))


def circuit_chart(recall: pl.DataFrame) -> alt.LayerChart | alt.FacetChart:
    """Per model and metric x space: the share of induction heads with a K-composition discovery
    from a previous-token head (``recall_rows``; a magnitude's top-n recall)."""
    mags = sorted({str(c).split(" · ")[0] for c in recall.filter(pl.col("measure") != "discoveries")["combo"]}) \
        if "measure" in recall.columns else []
    base = alt.Chart(recall).encode(x=alt.X("combo:N", title=None, sort=[f"{m} · {s}" for m in METRICS for s in SPACES],
                                            axis=alt.Axis(labelAngle=-25)),
                                    y=alt.Y("model:N", title=None))
    return alt.layer(
        base.mark_rect().encode(color=alt.Color("recall:Q", title="recall", scale=alt.Scale(domain=[0, 1], scheme="greens")),
                                tooltip=["model", "combo", alt.Tooltip("recall:Q", format=".2f"), "induction_heads",
                                         alt.Tooltip("precision:Q", format=".2f"), alt.Tooltip("measure:N", title="counted")]),
        base.mark_text(fontSize=11).encode(text=alt.Text("recall:Q", format=".2f"),
                                           color=alt.condition("datum.recall > 0.6", alt.value("white"), alt.value("black"))),
    ).properties(width=min(900, 110 * recall["combo"].n_unique()), height=28 * recall["model"].n_unique(),
                 title=alt.TitleParams("K-composition of each model's induction circuit", anchor="start", subtitleColor="#444",
                                       subtitle=["Share of its induction heads (last checkpoint) with a K-composition "
                                                 "discovery from a previous-token head (discovery recall)."]
                                       + (["A magnitude (" + ", ".join(mags) + ") has no discoveries: its cell is the share "
                                           "of the n induction heads among the n readers with the largest K score from a "
                                           "previous-token head (top-n recall)."] if mags else [])))


def footer(config: dict[str, Any] | None, versions: list[str]) -> str:
    libs = {}
    for name in ("compatlas", "altair", "duckdb", "polars", "vl-convert-python", "transformer-lens", "torch"):
        try:
            libs[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    merged: dict[str, set[str]] = {}
    for v in versions:
        for k, x in (json.loads(v) if v else {}).items():
            merged.setdefault(k, set()).add(str(x))
    extraction = ", ".join(f"{k} {' / '.join(sorted(v))}" for k, v in sorted(merged.items())) or "–"
    cfg = json.dumps({k: v for k, v in (config or {}).items() if k not in ("models", "training")}, default=str, indent=None)
    # a trained model is in both lists (its entry under models, its training run under training): named once
    models = ", ".join(dict.fromkeys([*(config or {}).get("models", {}), *(config or {}).get("training", {})]))
    return ("<footer><p>Report drawn " + datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
            + f". Libraries (report): {html.escape(', '.join(f'{k} {v}' for k, v in libs.items()))}."
            + f" Libraries (extraction): {html.escape(extraction)}.</p>"
            + (f"<p>Config (models: {html.escape(models)}):</p><pre>{html.escape(cfg)}</pre>" if config else
               "<p>Config: not given to the report.</p>") + "</footer>")
