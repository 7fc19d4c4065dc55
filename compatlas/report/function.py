"""Composition against function (docs/edge_attribution.md): per model, whether it has a
function to predict at all (``compatlas.function.agreement.measurability``), how well each metric x space
x comp's composition predicts edge attribution (composition_vs_function) with a bootstrap
interval, which cells are best or tied (``agreement.best_and_ties``), the lead cell's edges as a
scatter with the circuit marked, and how far EAP agrees with exact patching; over training, the
edge exact patching ranks first, every attribution method and its composition on one step axis;
the overview's figure across models is ``function_overview``. An atlas without edge attribution gets none of it and a line saying so."""

from __future__ import annotations

import html
from typing import Any

import altair as alt
import duckdb
import numpy as np
import polars as pl

from compatlas.function import agreement as ag
from compatlas.function.comp_agreement import (
    ORACLES,
    PRIOR,
    REFERENCES,
    SCALE,
    CompFunction,
    comp_function,
    stored_comp_function,
    verdict,
)
from compatlas.report import function_training
from compatlas.report import queries as q
from compatlas.report.page import Page, by_metric_space, correlation, fmt, note, order, table
from compatlas.tables import integer, number
from compatlas.vocab import COMPS, EDGE_METHODS

CIRCUIT, OTHER = "previous-token head → induction head", "other edge"
MIN_RANKED = 8  # patched edges below which EAP's Spearman against exact patching is not shown
WHAT = ("Each edge (writer head → a later reader's query, or its KV head's key or value) scored twice: by its "
        "<b>composition</b> (from the weights in the residual and token spaces, on the model's own activation "
        "statistics in the activation space) and by <b>edge attribution</b> (the change in the log-probability of the "
        "induced tokens when the edge alone carries its corrupted value; docs/edge_attribution.md). "
        "<b>Noise-aware</b> (what this page ranks by): the Spearman of each score with the product of two independent "
        "halves' attributions (the means over the even and over the odd sequences: unbiased for the squared "
        "function, with no term that grows with an edge's noise), and its AUROC for the edges whose attribution "
        "differs from zero (t-test, Benjamini-Hochberg). Beside every score, two <b>oracles</b> that know nothing "
        "of which edge does what: the edge's own sampling error (<i>scale</i>) and the mean |attribution| of its layer "
        "pair (<i>depth</i>), and a <b>prior</b> that needs neither function nor composition (nearer layers first). "
        "Each cell is placed in tiers: it <i>agrees with function</i> (the interval of its unbiased Spearman is above "
        "0), it is <i>beyond the prior</i> (it beats the prior beyond the paired interval), it <i>beats both "
        "oracles</i> so, and it <i>adds to scale and depth</i> (its partial Spearman beyond both oracles, their ranks "
        "regressed out of its ranks and the function's, has an interval above 0: it carries function that neither "
        "oracle carries, however small). The <b>noise ceiling</b>: how far two halves of the sequences agree with each other. "
        "<b>Against |attribution|</b> (the older figures, kept and labelled): Spearman with |attribution|, AUROC "
        "for the top of the function (the fewest edges holding half of a comp's total |attribution|); with few "
        "sequences an edge's |attribution| is mostly its noise, which grows with the size of its activations, so "
        "these reward predicting noise scale (the scale oracle wins them).")
RULES = (f"A comp has a function to predict when it has at least {ag.MIN_EDGES} edges (with fewer, a rank correlation "
         f"spreads by more than 0.23 by chance alone), at least {ag.MIN_TOP} edges whose attribution differs from zero "
         f"beyond its standard error (t-test over the sequences, Benjamini-Hochberg q <= {ag.SIGNAL_FDR:g}: a "
         f"random-init model's attribution is noise), a largest |attribution| of at least {ag.MIN_EFFECT:g} nats (with "
         "hundreds of sequences a random model's tiny effects become significant) and a top of the function of at "
         f"least {ag.MIN_TOP} edges (with one, "
         "an AUROC is one edge's rank). Intervals: 95% percentile bootstrap over edges "
         f"({ag.N_BOOT} replicates; the edges are treated as a sample, though they share heads and sequences); a cell "
         "is <b>best</b> only when the paired bootstrap difference to every other cell stays above 0, else the cells "
         "it does not beat are <b>tied</b> with it.")


def model_function(con: duckdb.DuckDBPyConnection, model: str, checkpoint: str) -> dict[str, CompFunction]:
    """Every comp's ``CompFunction`` of a model x checkpoint by the page's method per comp
    (queries.edge_methods); empty without edge attribution. Read back from the bootstrap the atlas
    stored when it was built (``stored_comp_function``); bootstrapped here for an atlas built before
    it stored one."""
    methods = q.edge_methods(con, model, checkpoint)
    if methods is None:
        return {}
    if q.has(con, "function_bootstrap", "spearman_unbiased_boot") and q.has(con, "function_agreement", "n_signal"):
        found = {c: stored_comp_function(con, model, checkpoint, m, c) for c, m in methods.items()}
    else:
        found = {c: comp_function(con, model, checkpoint, m, c, q.fdr(con)) for c, m in methods.items()}
    return {c: f for c, f in found.items() if f is not None}


def cell_name(c: tuple[str, str]) -> str:
    return f"{html.escape(c[0])} × {html.escape(c[1])}"


def with_interval(x: float | None, iv: tuple[float, float] | None) -> str:
    return fmt(x) + (f" [{fmt(iv[0], 2)}, {fmt(iv[1], 2)}]" if iv is not None and all(np.isfinite(iv)) else "")


def gate_line(fns: dict[str, CompFunction]) -> str:
    """Per comp: measurable (with its counts) or why not; comps with the same reason share it."""
    parts: list[str] = []
    why: dict[str, list[str]] = {}
    for c in COMPS:
        if c in fns:
            g = fns[c].gate
            if g.measurable:
                parts.append(f"<b>{c}</b>: {g.n_edges:,} edges, {g.n_signal:,} with attribution beyond its standard "
                             f"error, top of the function {g.n_top:,} edges")
            else:
                why.setdefault(g.why or "", []).append(c)
    parts += [f"<b>{', '.join(cs)}</b>: no function to predict: {html.escape(w)}" for w, cs in why.items()]
    return "; ".join(parts) + "."


def cell_names(cells: list[tuple[str, str]], most: int = 6) -> str:
    return ", ".join(cell_name(t) for t in cells[:most]) + (f" and {len(cells) - most} more" if len(cells) > most else "")


def adds_line(f: CompFunction) -> str:
    """Which cells carry function beyond both oracles (partial Spearman interval above 0), the largest
    first, with what they add to the function's rank variance; or that none does."""
    part = f.partial
    if part is None:
        return ""
    lo, hi = part.interval()
    adds = sorted((i for i, c in enumerate(f.cells) if c not in REFERENCES and np.isfinite(lo[i]) and lo[i] > 0),
                  key=lambda i: -part.partial[i])
    if not adds:
        return ". <b>No cell adds to scale and depth</b>: every partial Spearman beyond both oracles has an interval reaching 0"
    best = adds[0]
    return (f". Beyond both oracles, {len(adds)} cell{'s' if len(adds) != 1 else ''} add{'s' if len(adds) == 1 else ''} "
            f"function; the most, <b>{cell_name(f.cells[best])}</b>: partial Spearman "
            f"{with_interval(part.partial[best], (lo[best], hi[best]))}, {fmt(100 * part.added_r2[best], 2)}% of "
            "the function's rank variance")


def best_lines(fns: dict[str, CompFunction], cvf: pl.DataFrame) -> str:
    """Per measurable comp: the noise ceiling; the best composition cell by Spearman with the
    unbiased function estimate (or the tied cells) with its interval, the two oracles beside it,
    and whether it beats the scale oracle beyond the paired interval; then, labelled, the older
    ranking by AUROC against |attribution|."""
    out, old = [], []
    for c in COMPS:
        f = fns.get(c)
        if f is None or f.agreement is None:
            continue
        rows = cvf.filter(pl.col("comp") == c)
        ceiling = rows["noise_ceiling"].drop_nulls() if "noise_ceiling" in rows.columns else pl.Series([])
        within = (rows["noise_ceiling_within_layer_pair"].drop_nulls() if "noise_ceiling_within_layer_pair" in rows.columns
                  else pl.Series([]))
        ceil = (f", noise ceiling {fmt(number(ceiling[0]))}" + (f" ({fmt(number(within[0]))} within a layer pair)"
                                                                if len(within) else "")) if len(ceiling) else ""
        r = f.noise_ranking()
        if f.noise is not None and r is not None:
            best, tied = r
            sp = f.noise.spearman
            what = f"<b>{cell_name(best)}</b> ({with_interval(sp[f.cells.index(best)], f.interval(best, 'spearman', True))})"
            orc = "; ".join(f"{name} {with_interval(sp[f.cells.index(o)], f.interval(o, 'spearman', True))}"
                            for name, o in zip(("scale oracle", "depth oracle", "prior"), REFERENCES))
            said = verdict(f.tiers(best)) or "no tier can be told"
            lead = f"{what}, tied with {cell_names(tied)}" if tied else f"{what}, beyond every other cell"
            out.append(f"<b>{c}</b>{ceil}: best {lead}; {orc}; it {said}" + adds_line(f))
        elif ceil:
            out.append(f"<b>{c}</b>{ceil}: no split halves in this atlas, so no noise-aware figure")
        rk = f.ranking()
        if rk is not None:
            best, tied = rk
            a = f.agreement.auroc
            what = f"{cell_name(best)} (AUROC {with_interval(a[f.cells.index(best)], f.interval(best, 'auroc'))})"
            scale = f"scale oracle {with_interval(a[f.cells.index(SCALE)], f.interval(SCALE, 'auroc'))}"
            old.append(f"{c}: {what}" + (f", tied with {len(tied)} more" if tied else "") + f"; {scale}")
    html_ = ""
    if out:
        html_ += ("<p>Agreement with function, noise-aware (Spearman with the unbiased function estimate, 95% "
                  "interval):</p><ul>" + "".join(f"<li>{x}.</li>" for x in out) + "</ul>")
    if old:
        html_ += note("Against |attribution| (AUROC for the top of the function; rewards predicting noise scale, "
                      "kept for comparison): " + "; ".join(old) + ".")
    return html_


def tier_mark(t: dict[str, bool | None]) -> str:
    """A cell's four tiers as marks, in the table header's order: ✓ reached, · not, ? cannot be told."""
    return " ".join("?" if t.get(k) is None else "✓" if t[k] else "·"
                    for k in ("agrees", "beyond_prior", "beats_oracles", "adds_to_oracles"))


def agreement_table(cvf: pl.DataFrame, fns: dict[str, CompFunction]) -> str:
    """The view's figures of the measurable comps: the noise-aware Spearman and AUROC with their
    intervals and whether each beats the scale oracle, the oracles' own rows, then the figures
    against |attribution| (the z and p columns: in the view)."""
    ranks = {c: f.noise_ranking() for c, f in fns.items() if f.gate.measurable}
    rows = []
    for metric, space, _, by in by_metric_space(cvf):
        for comp in COMPS:
            if comp not in by or comp not in ranks:
                continue
            r, f, cell = by[comp], fns[comp], (metric, space)
            rk = ranks[comp]
            oracle = cell in REFERENCES
            mark = ("oracle" if cell in ORACLES else "prior" if cell == PRIOR else "" if rk is None else
                    "best" if rk[0] == cell and not rk[1] else "tied" if rk[0] == cell or cell in rk[1] else "")
            tiers = f.tiers(cell) if not oracle else {}
            rows.append([metric, space, comp, r["n_edges"], r.get("n_significant"),
                         with_interval(r.get("spearman_unbiased"), f.interval(cell, "spearman", True)),
                         with_interval(r.get("auroc_significant"), f.interval(cell, "auroc", True)), mark,
                         with_interval(r.get("partial_unbiased"), f.partial_interval(cell)) if cell not in ORACLES else "",
                         "" if oracle else tier_mark(tiers),
                         correlation(r.get("spearman_unbiased_within_layer_pair")), correlation(r.get("spearman_t")),
                         with_interval(r.get("auroc"), f.interval(cell, "auroc")),
                         with_interval(r.get("spearman"), f.interval(cell, "spearman")),
                         r["n_discoveries"]])
    return table(["metric", "space", "comp", "edges", "significant", "Spearman, unbiased [95%]",
                  "AUROC, significant edges [95%]", "rank", "partial beyond both oracles [95%]",
                  "tiers: agrees · beyond prior · beats oracles · adds", "unbiased, within a layer pair",
                  "Spearman with |t|", "AUROC, top of |attribution| [95%]", "Spearman with |attribution| [95%]",
                  "discoveries (edges)"], rows, cls="agree") + note(
        "Discoveries (edges) counts this table's edges that hold a discovery. A K or V edge ends in a key/value head, "
        "so in a grouped-query model a discovery shared by its query heads counts once here and once per query head "
        "in the table of every metric x space above (rows of <code>discoveries</code>).")


def method_line(methods: dict[str, str]) -> str:
    """Which attribution each comp's rows use, and by what rule (``queries.edge_methods``)."""
    parts = [f"{c} <b>{html.escape(m)}</b>" for c, m in methods.items()]
    return ("Attribution per comp, the method that agrees best with exact patching there (its top edge, then its "
            "Spearman; EAP on ties; the line below the table): " + "; ".join(parts) + ".")


def exact_line(eve: pl.DataFrame) -> str:
    """EAP (each method) against exact patching, per comp, in one line: whether the top edges
    agree; the Spearman over the patched edges where there are at least ``MIN_RANKED``; the top-k
    overlap where k is below the number patched (else it is 1 by construction)."""
    if eve.is_empty():
        return "No exact patching in this atlas for this model: the approximation is not checked here."
    parts = []
    for method in order(eve["method"].unique(), EDGE_METHODS):
        g = {r["comp"]: r for r in eve.filter(pl.col("method") == method).iter_rows(named=True)}
        bits = []
        for c in COMPS:
            if c not in g:
                continue
            r = g[c]
            n, k = int(r["n_exact"] or 0), int(r.get("top_k") or 5)
            n_random = n if r.get("n_random") is None else int(r["n_random"])
            bit = f"{c} top edge {'agrees' if r.get('top_edge_agrees') else 'differs'}"
            if n_random >= MIN_RANKED:
                lo, hi = r.get("spearman_lo"), r.get("spearman_hi")
                iv = (float(lo), float(hi)) if lo is not None and hi is not None else None
                bit += f", Spearman on the draw {with_interval(correlation(r['spearman']), iv)}"
            if n >= MIN_RANKED and k < n:
                bit += f", top-{k} overlap {fmt(r['top_k_overlap'])}"
            bits.append(bit)
        n_max = max(int(r["n_exact"] or 0) for r in g.values())
        n_top = max(int(r.get("n_top") or 0) for r in g.values())
        tops = (f", {n_top} of them at most the top edges of each method's |attribution| and of the composition score, "
                "added to a random draw stratified over both" if n_top else
                ", a random draw stratified over |attribution| and a composition score")
        parts.append(f"<b>{html.escape(method)}</b> against exact patching ({n_max} patched edges per comp at most{tops}; "
                     "the Spearman is on the random draw alone, so that it can still disagree; the top edge and the "
                     "top-k overlap on every patched edge; 95% intervals: Fisher's z): " + "; ".join(bits))
    few = integer(eve["n_exact"].fill_null(0).min()) < MIN_RANKED
    return ". ".join(parts) + "." + (f" A Spearman and a top-k overlap are shown from {MIN_RANKED} patched edges and "
                                     "a k below their number: with fewer edges a perfect order arises by chance too "
                                     "often, and an overlap of all of them is 1 by construction." if few else "")


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
        kind=pl.when("circuit").then(pl.lit(CIRCUIT)).otherwise(pl.lit(OTHER))).sort(["kind", "edge"], descending=[True, False])


def scatter_chart(pts: pl.DataFrame, model: str, checkpoint: str, method: str, metric: str, space: str) -> alt.LayerChart | alt.FacetChart:
    """Composition score (x) against |attribution| (y, symlog) of every K edge, the circuit's drawn over the rest."""
    positive = pts.filter(pl.col("fn") > 0)["fn"]
    constant = number(positive.median()) if len(positive) else 1.0  # linear below the typical edge, logarithmic above
    y = alt.Y("fn:Q", title="|edge attribution| (log-prob of induced tokens)",
              scale=alt.Scale(type="symlog", constant=constant))
    x = alt.X("score:Q", title=f"K-composition score ({metric}, {space} space)", scale=alt.Scale(zero=False))
    tip = ["edge:N", alt.Tooltip("score:Q", format=".4~g"), alt.Tooltip("attribution:Q", format=".3~g"),
           alt.Tooltip("stderr:Q", title="standard error", format=".2~g")]
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
    drawn = [c for c, n in ((others, pts.height - n_circ), (circ, n_circ)) if n]
    return alt.layer(*drawn).properties(width=560, height=340, title=alt.TitleParams(
        f"{model} @ {checkpoint}: K-composition against function", anchor="start", fontSize=14, subtitleColor="#444",
        subtitle=[f"Each point a K edge ({pts.height:,}; {n_circ_txt}). "
                  f"Attribution by {method}; y on a symlog scale (linear below {constant:.2g})."]))




def section(page: Page, con: duckdb.DuckDBPyConnection, d: Any, cuts: tuple[float, float],
            fns: dict[str, CompFunction] | None = None) -> None:
    """The model page's section; nothing at all where the atlas has no edge attribution view.
    ``fns``: ``model_function`` of the page's checkpoint (computed here when not given)."""
    if not q.has(con, "composition_vs_function", "method", "auroc"):
        return
    page.add("<h2 id='function'>Composition against function</h2>")
    fns = model_function(con, d.model, d.latest) if fns is None else fns
    methods = {c: f.method for c, f in fns.items()}  # queries.edge_methods' choice, made once in model_function
    if not methods:
        page.add(note("No edge attribution for this model (edge attribution disabled, or a one-layer model)."))
        return
    cvf = q.composition_vs_function(con, d.model, d.latest, methods)
    measurable = [c for c in COMPS if c in fns and fns[c].gate.measurable]
    page.add(note(WHAT + " " + method_line(methods)), note(RULES), f"<p>{gate_line(fns)}</p>")
    query = (f"<code>SELECT * FROM composition_vs_function WHERE model = '{html.escape(d.model)}' AND checkpoint = "
             f"'{html.escape(d.latest)}'</code>")
    if not measurable:
        page.add(f"<p><b>No function to predict</b> in this model at {html.escape(d.latest)}: no agreement figure is "
                 f"shown, as none would mean anything. The view still holds them: {query}.</p>")
    else:
        page.add(best_lines(fns, cvf), agreement_table(cvf, fns))
        if len(measurable) < len(fns):
            page.add(note("The comps without a function to predict are left out of the table; the view has them: "
                          f"{query}."))
    page.add(f"<p>{exact_line(q.eap_vs_exact(con, d.model, d.latest))}</p>")
    # the scatter draws the cell the section crowns for K (noise-aware), else the page's lead cell
    crowned = fns["K"].noise_ranking() if "K" in measurable else None
    cell = crowned[0] if crowned is not None else d.lead
    if cell is not None and "K" in measurable:
        df = q.edge_scatter(con, d.model, d.latest, methods["K"], *cell)
        if not df.is_empty():
            grouped = d.info.get("n_kv_heads") not in (None, d.info.get("n_heads"))
            prev, ind = d.roles(*cuts)
            pts = edge_points(df, prev, ind, grouped)
            page.figure(scatter_chart(pts, d.model, d.latest, methods["K"], *cell), f"{d.stem}__function_scatter")
    elif "K" in fns:
        page.add(note("No scatter of K-composition against function: K has no function to predict here."))
    function_training.section(page, con, d)
