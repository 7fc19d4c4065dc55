"""The atlas report: an overview page and a page per model, self-contained HTML (the Vega
JavaScript inlined, nothing fetched), and a PNG of each figure on them.

``out_dir/index.html`` (the overview: ``overview``) links ``out_dir/model-{model}.html`` (``model``).
Everything is read from ``results/atlas.duckdb`` read-only through ``queries``; ``page`` holds the
shell, one module per section draws its figures. Model names outside ``[A-Za-z0-9._+-]`` become
``-`` in file names.
"""

from __future__ import annotations

import html
import os
from pathlib import Path
from typing import Any

import duckdb
import polars as pl

from compatlas.atlas import connect as atlas_connect
from compatlas.report import exclusions, function, function_overview, overview
from compatlas.report import queries as q
from compatlas.report.audits import metric_audit_table
from compatlas.report.findings import why_none
from compatlas.report.model import ModelData, build_page, load
from compatlas.report.page import Page, note, safe_name
from compatlas.report.png import PngPool
from compatlas.report.training import runs_table

__all__ = ["build_report", "safe_name"]

PNG_WORKERS = max(1, min(2, os.cpu_count() or 1))
# DuckDB's own default takes 80% of the machine's memory for a scan of a large atlas (a 70B
# model's 349M rows went past 6 GB); bounded, its aggregations stream and spill instead
DUCKDB_MEMORY = "2GB"

INTRO = ("How strongly each attention head (the <i>writer</i>) writes into what a head of a later layer (the "
         "<i>reader</i>) reads, through its queries (Q-composition), keys (K) or values (V). The answer leads with "
         "calibration: a pair is a <b>discovery</b> when its score stands above this model's own non-causal pairs "
         "(its mirror images: a reader in a layer below its writer's, which can never read it) at the configured false discovery rate "
         "(Benjamini-Hochberg q-value). Each model's page has its circuit, heatmaps, training and behaviour.")


def build_report(db_path: str | Path, out_dir: str | Path, config: dict[str, Any] | None = None,
                 png: bool = True) -> list[Path]:
    """Write ``out_dir/index.html`` and a page per model (and a PNG per figure when ``png``)
    from the atlas database, opened read-only; report files of an earlier run that this one did
    not write are removed. Returns the files written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    con = atlas_connect(db_path)  # resolves the views' shard paths, relative to the atlas's folder
    con.execute(f"SET memory_limit = '{DUCKDB_MEMORY}'")
    pool = PngPool(PNG_WORKERS) if png else None  # PNGs drawn by worker processes while the pages are built
    try:
        written = _build(con, out_dir, config, png, pool)
        if pool is not None:
            pool.wait()
    finally:
        con.close()
        if pool is not None:
            pool.close()
    for stale in [*out_dir.glob("*.png"), *out_dir.glob("model-*.html")]:
        if stale not in written:
            stale.unlink()
    return written


def _build(con: duckdb.DuckDBPyConnection, out_dir: Path, config: dict[str, Any] | None, png: bool,
           pool: PngPool | None) -> list[Path]:
    ckpts = q.checkpoints(con)
    q_cut = q.fdr(con)
    cuts = (q.threshold(con, "prev_token_mean", 0.4), q.threshold(con, "induction_mean", 0.4))
    versions = ckpts["versions"].drop_nulls().unique().to_list() if "versions" in ckpts.columns else []
    foot = overview.footer(config, versions)
    data: list[ModelData] = [load(con, m, ckpts, q_cut, cuts) for m in ckpts["model"].unique(maintain_order=True)]
    written: list[Path] = []
    left_out = exclusions.excluded(con)  # said on the index and on each page it affects
    # each model's agreement with function, bootstrapped once for its page and the overview
    fns = {d.model: function.model_function(con, d.model, d.latest) for d in data}
    for d in data:
        written += build_page(con, d, out_dir, q_cut, foot, png, pool, exclusions.notice(left_out, d.model),
                              fns[d.model]).written

    page = Page(out_dir, "index.html", "compatlas: attention-head composition atlas", png, pool)
    page.add("<h1>compatlas: attention-head composition atlas</h1>", exclusions.notice(left_out), note(INTRO))
    if not data:
        page.add("<p><b>No results:</b> the atlas has no models and no composition scores yet.</p>")
    else:
        page.add("<nav>" + " ".join(f"<a href='{html.escape(d.page)}'>{html.escape(d.model)}</a>" for d in data) + "</nav>",
                 "<h2 id='models'>Models</h2>", overview.models_table(data, cuts, q_cut),
                 "<h2 id='finds'>How each metric x space finds the induction heads</h2>",
                 note("K-composition with previous-token heads, last checkpoint: <b>recall</b> = share of the induction "
                      "heads with a discovery from a previous-token head, <b>precision</b> = share of the readers with "
                      "such a discovery that are induction heads. A magnitude (contribution), whose heavy-tailed null "
                      "leaves it no discoveries to count, gets its <b>top-n recall</b> instead: the share of the n "
                      "induction heads among the n readers with the largest K score from a previous-token head "
                      "(its precision there is the same number). " + q_note(q_cut)),
                 overview.finds_table(data, q_cut))
        recall = pl.DataFrame([r for d in data if why_none(d.summary, q_cut) is None for r in overview.recall_rows(d)])
        # models without calibration (an older atlas, a partial run) have no depth profile: none may be left
        profiles = [p.with_columns(model=pl.lit(d.model), depth=pl.col("reader_layer") / max(int(d.info["n_layers"]) - 1, 1),
                                   share=pl.col("n") / pl.col("pairs"))
                    for d in data if d.lead and q_cut is not None
                    and not (p := q.depth_profile(con, d.model, d.latest, *d.lead, q_cut)).is_empty()]
        profile = pl.concat(profiles, how="diagonal_relaxed") if profiles else pl.DataFrame()
        page.add("<h2 id='across'>Across models</h2>")
        if not profile.is_empty() and profile["n"].sum() > 0:
            page.figure(overview.depth_chart(profile), "overview__depth")
        elif not profile.is_empty():
            page.add(note("No model has a discovery in its lead metric x space: no depth profile to draw."))
        if "recall" in recall.columns and recall["recall"].is_not_null().any():
            page.figure(overview.circuit_chart(recall), "overview__induction_circuit")
        else:
            page.add(note("No model has induction heads with calibrated discoveries: no induction-circuit figure."))
        outcomes = {d.model: d.outcome for d in data if d.outcome is not None}
        if outcomes:
            page.add(runs_table(outcomes, lambda m: f"<a href='model-{safe_name(m)}.html#training'>{html.escape(m)}</a>"))
        page.add(function_overview.overview_table(con, data, fns))
        page.add(metric_audit_table(q.metric_audit(con)))
    page.write(foot)
    return [*written, *page.written]


def q_note(q_cut: float | None) -> str:
    return f"Discoveries: q <= {q_cut:g}." if q_cut is not None else "This atlas has no calibration."
