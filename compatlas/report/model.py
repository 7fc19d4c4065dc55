"""A model's page: the circuit view, the heatmap, training trajectories, induction behaviour,
head scores and ablation, and the invariance audit; plus ``ModelData``, what the overview and
the page read of one model."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import polars as pl

from compatlas.behaviour import formation as fm
from compatlas.report import behaviour, blocks, circuit, findings, function, heatmaps, training
from compatlas.report import queries as q
from compatlas.report.audits import invariance_chart
from compatlas.report.page import Page, esc, fmt, note, safe_name, step
from compatlas.tables import integer
from compatlas.vocab import NORMALISED_METRICS


@dataclass
class ModelData:
    model: str
    info: dict[str, Any]           # the models row of the last checkpoint
    checkpoints: pl.DataFrame      # this model's rows of queries.checkpoints, in step order
    latest: str
    combos: list[tuple[str, str]]  # (metric, space) scored at the last checkpoint
    lead: tuple[str, str] | None   # the metric x space the page opens on (circuit.lead_cell)
    summary: pl.DataFrame          # queries.calibration_summary of the last checkpoint
    edges: pl.DataFrame            # queries.discoveries of the last checkpoint
    heads: pl.DataFrame            # head_scores of the last checkpoint
    cvb: pl.DataFrame              # composition_vs_behaviour of the last checkpoint
    outcome: fm.TrainingOutcome | None
    candidates: bool = False       # edges are the smallest-p pairs, not discoveries (there are none)
    cuts: tuple[float, float] = (0.4, 0.4)  # head-score cuts of a previous-token and an induction head
    # K discoveries from a previous-token head into an induction head, every metric x space (queries.circuit_edges)
    circuit: pl.DataFrame = field(default_factory=pl.DataFrame)
    counts: pl.DataFrame = field(default_factory=pl.DataFrame)  # circuit.circuit_counts: what chose ``lead``
    top_recall: pl.DataFrame = field(default_factory=pl.DataFrame)  # model.top_recall of its magnitude metrics

    @property
    def stem(self) -> str:
        return safe_name(self.model)

    @property
    def page(self) -> str:
        return f"model-{self.stem}.html"

    def roles(self, prev_cut: float, ind_cut: float) -> tuple[pl.DataFrame, pl.DataFrame]:
        """(previous-token heads, induction heads) of the last checkpoint, strongest first."""
        return roles(self.heads, prev_cut, ind_cut)

    def lead_sentence(self) -> str:
        """Why the page opens on ``lead`` (circuit.lead_sentence)."""
        return "" if self.lead is None else circuit.lead_sentence(self.counts, self.lead)


def roles(heads: pl.DataFrame, prev_cut: float, ind_cut: float) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(previous-token heads, induction heads) of ``heads`` (head_scores), strongest first; an
    induction head reads from an earlier layer, so none is in the first."""
    if heads.is_empty():
        return heads, heads
    readers = heads.filter(pl.col("layer") > heads["layer"].min())
    return (heads.filter(pl.col("prev_token_mean") >= prev_cut).sort("prev_token_mean", descending=True),
            readers.filter(pl.col("induction_mean") >= ind_cut).sort("induction_mean", descending=True))


def load(con: duckdb.DuckDBPyConnection, model: str, ckpts: pl.DataFrame, q_cut: float | None,
         cuts: tuple[float, float] | None = None) -> ModelData:
    """What the overview and the model's page read of ``model``. ``cuts``: the head-score cuts of
    a previous-token and an induction head (None: those the atlas was built with). The lead
    metric x space, which the circuit's menu, the heatmap, the findings, the function scatter and
    the overview's depth profile all show, is chosen here once (circuit.lead_cell)."""
    cuts = cuts or (q.threshold(con, "prev_token_mean", 0.4), q.threshold(con, "induction_mean", 0.4))
    mine = ckpts.filter(pl.col("model") == model)
    info = mine.filter(pl.col("latest")).row(0, named=True)
    latest = info["checkpoint"]
    summary = q.calibration_summary(con, model, latest, q_cut)
    combos = ([] if summary.is_empty() else
              [tuple(r) for r in summary.select("metric", "space").unique().sort("metric", "space").iter_rows()])
    outcome = None
    stepped = mine.filter(pl.col("checkpoint_step").is_not_null())
    if stepped.height >= 2:
        hs = q.head_scores_over_training(con, model, stepped)
        pair = fm.eventual_pair(hs)
        curves = q.pair_curves(con, model, pair, stepped) if pair is not None else pl.DataFrame()
        outcome = fm.training_outcome(hs, q.loss(con, model), curves)
    edges = q.discoveries(con, model, latest, q_cut)
    candidates = edges.is_empty() and bool(combos)
    if candidates:  # nothing passes the FDR: show where the model comes closest, said as such
        edges = q.strongest(con, model, latest)
    edges = circuit_edges_of(con, model, latest, edges, candidates, combos)
    heads = q.rows(con, "head_scores", model, latest)
    prev, ind = roles(heads, *cuts)
    # no discoveries at all (candidates): no circuit edge either, and no query for one
    found = pl.DataFrame() if candidates else q.circuit_edges(con, model, latest, q_cut, _heads(prev), _heads(ind))
    counts = circuit.circuit_counts(found, summary)
    lead = circuit.lead_cell(counts, heatmaps.lead_combo(combos)) if combos else None
    mags = sorted({m for m, _ in combos if m not in NORMALISED_METRICS})
    recall = top_recall(q.rows(con, "reader_best_composition", model, latest) if mags else pl.DataFrame(), mags)
    return ModelData(model, info, mine, latest, combos, lead, summary, edges, heads,
                     q.rows(con, "composition_vs_behaviour", model, latest), outcome, candidates, cuts, found, counts, recall)


def circuit_edges_of(con: duckdb.DuckDBPyConnection, model: str, checkpoint: str, edges: pl.DataFrame,
                     candidates: bool, combos: list[tuple[str, str]]) -> pl.DataFrame:
    """What the circuit view draws, each row with its ``kind`` (circuit.KIND_DASH): the
    discoveries (``candidates``: the smallest-p pairs) of the normalised metrics, and a magnitude
    metric's largest scores (queries.strongest by score), never its discoveries alone: its
    heavy-tailed null leaves it few or none, and its menu showed three empty panels."""
    mags = sorted({m for m, _ in combos if m not in NORMALISED_METRICS})
    if edges.is_empty() and not mags:
        return edges
    mine = edges.filter(~pl.col("metric").is_in(mags)) if edges.height else edges
    parts = [mine.with_columns(kind=pl.lit(circuit.SMALLEST_P if candidates else circuit.DISCOVERY))] if mine.height else []
    if mags and (big := q.strongest(con, model, checkpoint, metrics=mags, by="score")).height:
        parts.append(big.with_columns(kind=pl.lit(circuit.LARGEST)))
    return pl.concat(parts, how="diagonal_relaxed") if parts else edges.clear()


def top_recall(readers: pl.DataFrame, metrics: list[str]) -> pl.DataFrame:
    """A magnitude's view of the induction heads, which has no discoveries to count: per metric
    x space of ``metrics``, of the ``n_ind`` induction heads how many (``hits``) are among the
    n_ind readers with the largest K score from a previous-token head (reader_best_composition's
    rows): recall and precision at n_ind, which are one number."""
    if readers.is_empty() or not metrics:
        return pl.DataFrame(schema={"metric": pl.Utf8, "space": pl.Utf8, "hits": pl.Int64, "n_ind": pl.Int64})
    k = readers.filter((pl.col("comp") == "K") & pl.col("metric").is_in(metrics)).with_columns(
        n_ind=pl.col("is_induction").sum().over("metric", "space"),
        r=pl.col("best_score").rank("ordinal", descending=True).over("metric", "space"))
    return (k.group_by("metric", "space").agg(hits=(pl.col("is_induction") & (pl.col("r") <= pl.col("n_ind"))).sum(),
                                               n_ind=pl.col("n_ind").first()).cast({"hits": pl.Int64, "n_ind": pl.Int64})
            .sort("metric", "space"))


def _heads(df: pl.DataFrame) -> list[tuple[int, int]]:
    return [] if df.is_empty() else list(zip(df["layer"].to_list(), df["head"].to_list()))


def describe(d: ModelData) -> str:
    i = d.info
    kv = f" ({fmt(i.get('n_kv_heads'))} KV heads)" if i.get("n_kv_heads") not in (None, i.get("n_heads")) else ""
    src = i.get("source_kind") or "–"
    if i.get("source_name"):
        src += f": {i['source_name']}"
    bits = [f"{esc(i.get('architecture'))}", f"{esc(i.get('n_layers'))} layers x {esc(i.get('n_heads'))} heads{kv}",
            f"d_model {esc(i.get('d_model'))}", f"d_head {esc(i.get('d_head'))}", f"vocabulary {esc(i.get('d_vocab'))}",
            f"norm {esc(i.get('norm_type'))}", f"processing {esc(i.get('processing'))}", f"source {html.escape(src)}",
            "<b>quantised weights</b> (their spectra carry quantisation noise, which shifts svd_bound and the "
            "spectrum-kept null)" if i.get("quantized") else "not quantised"]
    n = d.checkpoints.height
    if n > 1:
        steps = d.checkpoints["checkpoint_step"].drop_nulls()
        bits.append(f"{n} checkpoints" + (f", steps {step(steps.min())} to {step(steps.max())}" if len(steps) else "")
                    + f"; this page shows the last ({html.escape(d.latest)}) unless a figure says otherwise")
    return "<p>" + ", ".join(bits) + ".</p>"


def _too_small(summary: pl.DataFrame, q_cut: float | None) -> str:
    """A sentence when no pair could be a discovery at all: with N null pairs the smallest p is
    1 / (N + 1), and Benjamini-Hochberg over m pairs needs p <= q_cut for one of them even if all
    m reach that floor."""
    if q_cut is None or summary.is_empty() or "n_null" not in summary.columns or summary["n_null"].null_count():
        return ""
    n_null = integer(summary["n_null"].max())
    if 1 / (n_null + 1) <= q_cut:
        return ""
    return (f" With {n_null} non-causal pairs the smallest possible p is 1/{n_null + 1} = {1 / (n_null + 1):.3g}, above"
            f" {q_cut:g}: this model is too small for calibrated discoveries at all; read its circuit from the head"
            " scores and the training curves below.")


def build_page(con: duckdb.DuckDBPyConnection, d: ModelData, out_dir: Path, q_cut: float | None,
               footer: str, png: bool, pool: Any = None, left_out: str = "",
               fns: dict[str, function.CompFunction] | None = None) -> Page:
    cuts = d.cuts  # the head-score cuts ``load`` chose the lead with: the page's roles are the same
    page = Page(out_dir, d.page, f"compatlas: {d.model}", png, pool)
    s = d.stem
    page.add("<nav><a href='index.html'>← all models</a> <a href='#circuit'>circuit</a> <a href='#heatmap'>heatmap</a>"
             + (" <a href='#training'>training</a>" if d.outcome else "")
             + (" <a href='#function'>function</a>" if q.has(con, "composition_vs_function", "method") else "")
             + " <a href='#behaviour'>induction behaviour</a> <a href='#audits'>audits</a></nav>",
             f"<h1>{html.escape(d.model)}</h1>", left_out, describe(d))
    page.add("<h2 id='circuit'>The circuit</h2>")
    if not d.combos:
        page.add(note("No composition scores: a one-layer model has no writer head in an earlier layer than a reader."
                      if (d.info.get("n_layers") or 2) < 2 else "No composition scores for this model yet."))
    elif d.edges.is_empty():
        page.add(note("This atlas has no calibration (no p-values): rebuild it to see the circuit."))
    else:
        if d.candidates:
            why = (f"no head pair of this model composes beyond its own non-causal pairs at q <= {q_cut:g}"
                   if q_cut is not None else "this atlas has no discoveries view")
            page.add(note(f"<b>No discoveries</b>: {why}.{_too_small(d.summary, q_cut)} Drawn instead, and not to be "
                          "read as a circuit: the pairs with the smallest p."))
        nodes = circuit.node_frame(int(d.info["n_layers"]), int(d.info["n_heads"]), d.heads, *cuts)
        assert d.lead is not None  # load chooses a lead whenever there are combos
        page.figure(circuit.circuit_chart(d.edges, nodes, d.model, d.latest, d.lead, q_cut, d.candidates, d.combos,
                                          d.summary), f"{s}__circuit")
        page.add(note(d.lead_sentence() + " The tables below follow the menu."))
        floor = findings.floor_summary(con, d.model, d.latest, findings.kv_group(d.info))
        page.add(findings.top_discoveries(d.edges, d.info, d.model, d.combos, d.lead, d.candidates, floor, q_cut))
    if d.combos:
        assert d.lead is not None  # as above
        metric, space = d.lead
        L, H = int(d.info.get("n_layers") or 1), int(d.info.get("n_heads") or 1)
        big = blocks.use_blocks(L, H)
        page.add("<h2 id='heatmap'>" + ("Every layer pair" if big else "Every head pair") + "</h2>",
                 note(f"The heatmap shows {html.escape(metric)} in {html.escape(space)} space (the one the circuit's "
                      "menu opens on, by the rule stated there); the table below counts the "
                      "discoveries of every metric x space. Any other: <code>SELECT * FROM composition_z WHERE "
                      f"model = '{html.escape(d.model)}' AND latest AND metric = ... AND space = ...</code>."))
        if big:  # aggregated in DuckDB: the page gets layers^2 cells per comp, whatever the heads
            page.add(note(f"This model has {L * H:,} heads, {blocks.causal_pairs(L, H):,} causal head pairs per comp: "
                          f"too many to draw a cell each. The map has a cell per writer layer x reader layer, the strongest "
                          f"of its {H} x {H} head pairs (smallest p, then largest score); the circuit above and the "
                          "findings tables give the discoveries and the strongest pairs themselves."))
            bl = q.heatmap_blocks(con, d.model, d.latest, metric, space, q_cut)
            page.figure(blocks.block_chart(bl, d.model, d.latest, metric, space, L, H, q_cut), f"{s}__heatmap",
                        datasets={blocks.BLOCK_DATA: blocks.block_rows(bl)})
        else:
            df = q.pairs(con, d.model, d.latest, metric, space)
            H = max(H, integer(df["writer_head"].max()) + 1, integer(df["reader_head"].max()) + 1)
            page.figure(heatmaps.heatmap_chart(df, d.model, d.latest, metric, space, H, q_cut), f"{s}__heatmap",
                        datasets={heatmaps.HEATMAP_DATA: heatmaps.heatmap_rows(df, H, q_cut),
                                  heatmaps.HEATMAP_FOUND: heatmaps.heatmap_found(df, H, q_cut)},
                        png=df.height <= heatmaps.PNG_MAX_CELLS)
        page.add(heatmaps.calibration_table(d.summary))
    if d.outcome is not None:
        page.add("<h2 id='training'>Over training</h2>")
        if d.outcome.pair is None:
            page.add(note("A one-layer model: no head pairs to follow over training."))
        else:
            page.add(training.describe(d.outcome))
            page.figure(training.trajectory_chart(d.outcome, strength(con, d), d.model), f"{s}__training")
            page.add(training.verdict_table(d.outcome))
    function.section(page, con, d, cuts, fns)
    behaviour_part(page, con, d, findings.why_none(d.summary, q_cut))
    page.add("<h2 id='audits'>Audits</h2>")
    inv = q.rows(con, "invariance", d.model, d.latest)
    if inv.is_empty():
        page.add(note("No invariance audit for this model."))
    else:
        page.figure(invariance_chart(inv, d.model, d.latest), f"{s}__invariance")
    page.add(note("The metric audit (Lieberum's axioms on canonical constructions) is model-free: "
                  "<a href='index.html#axioms'>on the overview</a>."))
    page.write(footer)
    return page


def strength(con: duckdb.DuckDBPyConnection, d: ModelData) -> pl.DataFrame:
    """Mean B-role induction strength per checkpoint step (from induction_summary)."""
    summ = q.rows(con, "induction_summary", d.model)
    if summ.is_empty() or "mean_strength" not in summ.columns:
        return pl.DataFrame()
    st = d.checkpoints.select("checkpoint", pl.col("checkpoint_step").cast(pl.Float64).alias("step"))
    return (summ.filter(pl.col("role") == "B").join(st, on="checkpoint").group_by("step")
            .agg(pl.col("mean_strength").mean().alias("strength")).drop_nulls().sort("step"))


def behaviour_part(page: Page, con: duckdb.DuckDBPyConnection, d: ModelData, why_none: str | None = None) -> None:
    page.add("<h2 id='behaviour'>Induction behaviour (forward passes)</h2>")
    toks = q.rows(con, "induction_tokens", d.model, d.latest)
    s = d.stem
    if toks.is_empty():
        page.add(note("No induction sweep for this model (induction disabled, or an encoder without logits)."))
    else:  # each figure needs its columns of induction_tokens; an older atlas may lack some
        for need, draw, stem in ((behaviour.POWER_COLUMNS, behaviour.powers_chart, "induction_powers"),
                                 (behaviour.POWER_COLUMNS + behaviour.NEAR_COLUMNS, behaviour.near_b_chart, "induction_near_b")):
            missing = [c for c in need if c not in toks.columns]
            if missing:
                page.add(note(f"No {stem.replace('_', ' ')} figure: this atlas's induction_tokens lacks {', '.join(missing)}."))
            else:
                page.figure(draw(toks, d.model, d.latest), f"{s}__{stem}")
        if not [c for c in behaviour.POWER_COLUMNS + ("token_id", "token_text") if c not in toks.columns]:
            page.add(behaviour.top_tokens(toks))
    heads = d.outcome.heads if d.outcome is not None else d.heads
    if not heads.is_empty():
        page.add("<h3>Head scores and ablation</h3>")
        page.figure(behaviour.head_scores_chart(heads, d.model), f"{s}__head_scores")
    if not d.cvb.is_empty():
        page.add("<h3>Does composition find the induction heads?</h3>",
                 note("Per reader head: its strongest composition with an earlier previous-token head, against whether "
                      "it is an induction head."
                      + (f" Precision and recall count discoveries; for this model, discoveries: {html.escape(why_none)}. "
                         "Its recall of 0 is not the method missing the circuit; the head scores above show it."
                         if why_none else "")), behaviour.payoff_table(d.cvb))
