"""What the atlas left out, said on the pages it affects: a shard missing, truncated or failing
its checksum (``excluded_shards``) leaves its view without that model's rows, and a section
that draws from that view would otherwise look complete, or say "none" where it means "unknown"."""

from __future__ import annotations

import html
import re

import polars as pl

# The report's sections each view feeds (ablation and head scores: the behaviour section, ...)
SECTIONS = {
    "composition": "the circuit, heatmaps, discoveries, composition vs behaviour",
    "composition_null": "the calibration of every finding (composition's null)",
    "calibration": "the circuit and discoveries (p- and q-values)",
    "invariance": "the invariance audit",
    "metric_audit": "the metric audit",
    "induction_tokens": "induction behaviour (the sweep)",
    "head_scores": "head scores and ablation, induction heads, composition vs behaviour",
    "edge_attribution": "function: edge attribution and composition vs function",
    "training_loss": "training",
}
_MODEL = re.compile(r"/model=([^/]+)/")


def excluded(con) -> pl.DataFrame:
    """``excluded_shards`` (as this connection sees it) with the model each shard belongs to
    (None for a shard of the whole run, e.g. the metric audit)."""
    try:
        df = con.sql("SELECT view, path, error FROM excluded_shards ORDER BY view, path").pl()
    except Exception:  # noqa: BLE001 -- an atlas built before the table existed
        return pl.DataFrame(schema={"view": pl.Utf8, "path": pl.Utf8, "error": pl.Utf8, "model": pl.Utf8})
    return df.with_columns(model=pl.col("path").map_elements(lambda p: (m.group(1) if (m := _MODEL.search(p)) else None),
                                                             return_dtype=pl.Utf8))


def notice(ex: pl.DataFrame, model: str | None = None) -> str:
    """An HTML notice of the shards left out (of ``model`` and of the whole run, or all of them
    on the index), and the sections they leave incomplete; '' when none."""
    rows = ex if model is None else ex.filter(pl.col("model").is_null() | (pl.col("model") == model))
    if rows.is_empty():
        return ""
    views = rows["view"].unique(maintain_order=True).to_list()
    incomplete = "; ".join(f"<b>{html.escape(SECTIONS.get(v, v))}</b>" for v in views)
    items = "".join(f"<li><code>{html.escape(r['path'])}</code> ({html.escape(r['view'])}): {html.escape(r['error'])}</li>"
                    for r in rows.iter_rows(named=True))
    return ("<div class='excluded' role='alert'><p><b>Incomplete: " + f"{rows.height} result shard"
            + ("s" if rows.height != 1 else "") + " left out of this atlas</b> (missing, truncated or failing its "
            f"checksum), so these sections lack their rows: {incomplete}. The next <code>snakemake</code> run remakes "
            f"them; <code>compatlas query \"SELECT * FROM excluded_shards\"</code> lists them.</p><ul>{items}</ul></div>")
