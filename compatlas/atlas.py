"""The DuckDB atlas: views over the Parquet shards, and the extraction metadata as `models`.

Rebuilding is cheap (no data is copied): the views read the shards in place. The file is
built under a temporary name and renamed, so readers never see a half-built database.

Relocatable: the views name their shards relative to the database's folder, so a copied or
moved ``results/`` keeps working; DuckDB resolves such paths against ``file_search_path``,
which ``connect`` sets to that folder (plain ``duckdb.connect`` users: ``SET file_search_path``).

A shard that does not open (truncated, corrupt) is left out of its view with a warning in the
log and a row in the ``excluded_shards`` table (view, path, error), rather than failing the
build: one bad shard would otherwise break every query of its view, and a failed atlas job
loses the previous ``atlas.duckdb`` (Snakemake removes a job's outputs before it runs). Each
build also leaves a copy of itself (``last_good_path``) that queries fall back on meanwhile.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import duckdb
import polars as pl

from compatlas.storage import atomic_path
from compatlas.tables import EXCLUDED_SHARDS_SCHEMA, MODELS_SCHEMA, SHARD_VIEWS

log = logging.getLogger(__name__)

# Views derived from the ones over shards (SQL, so they follow the shards whenever the atlas is rebuilt).
COMPOSITION_Z = """CREATE VIEW composition_z AS SELECT c.*,
    c.score - c.baseline_gaussian_mean AS score_minus_gaussian,
    (c.score - c.baseline_spectrum_mean) / NULLIF(c.baseline_spectrum_std, 0) AS z_spectrum,
    (c.score - c.baseline_gaussian_mean) / NULLIF(c.baseline_gaussian_std, 0) AS z_gaussian,
    p.n_null, p.p_value, p.q_value, k.checkpoint_step, k.latest
    FROM composition c LEFT JOIN calibration p
    USING (model, checkpoint, processing, metric, space, comp, writer_layer, writer_head, reader_layer, reader_head)
    LEFT JOIN checkpoints k USING (model, checkpoint)"""

# Checkpoints in training order: the step (null for a model without a series) and `latest`, each
# model's last checkpoint (highest step; a model without steps has one), so "the last checkpoint
# of each model" is `WHERE latest` in checkpoints, composition_z and discoveries.
CHECKPOINTS = """CREATE VIEW checkpoints AS SELECT model, checkpoint, checkpoint_step,
    row_number() OVER (PARTITION BY model ORDER BY checkpoint_step DESC NULLS LAST, checkpoint DESC) = 1 AS latest
    FROM models"""

# The calibrated answer: causal pairs whose q-value (Benjamini-Hochberg over the pairs of one
# model x checkpoint x metric x space x comp) is at most the configured false discovery rate.
DISCOVERIES = """CREATE VIEW discoveries AS SELECT * FROM composition_z WHERE q_value <= {fdr}"""

# Per model x filler setting x role: the mean A (B) power over tokens, its spread across tokens,
# and B vs nearby-B vs random. Tokens' sequences are independent, so standard errors add in quadrature.
INDUCTION_SUMMARY = """CREATE VIEW induction_summary AS SELECT
    model, checkpoint, filler_before, filler_between, role,
    count(*) AS n_tokens, sum(n) AS n_sequences,
    avg(mean) AS mean_strength, sqrt(sum(stderr * stderr)) / count(*) AS mean_stderr,
    stddev_samp(mean) AS power_spread, quantile_cont(mean, 0.1) AS power_p10, quantile_cont(mean, 0.9) AS power_p90,
    avg(near_b_mean) AS near_b_mean, sqrt(sum(near_b_stderr * near_b_stderr)) / count(*) AS near_b_stderr,
    avg(random_mean) AS random_mean, sqrt(sum(random_stderr * random_stderr)) / count(*) AS random_stderr
    FROM induction_tokens GROUP BY ALL"""

# For every reader head: its strongest composition (per metric, space, comp) with an earlier
# previous-token head (threshold, or the model's best one outside the last layer if none passes), beside its induction score and ablation effect.
READER_BEST = """CREATE VIEW reader_best_composition AS
WITH ranked_prev AS (  -- heads of the last layer have no readers
    SELECT model, checkpoint, layer, head, prev_token_mean,
           row_number() OVER (PARTITION BY model, checkpoint ORDER BY prev_token_mean DESC, layer, head) AS r
    FROM head_scores h
    WHERE layer < (SELECT max(layer) FROM head_scores l WHERE l.model = h.model AND l.checkpoint = h.checkpoint)),
prev_heads AS (SELECT model, checkpoint, layer, head FROM ranked_prev WHERE prev_token_mean >= {prev} OR r = 1),
best AS (
    SELECT c.model, c.checkpoint, c.metric, c.space, c.comp, c.reader_layer AS layer, c.reader_head AS head,
           max(c.score) AS best_score,
           max((c.score - c.baseline_spectrum_mean) / NULLIF(c.baseline_spectrum_std, 0)) AS best_z_spectrum,
           arg_max(c.writer_layer || '.' || c.writer_head, c.score) AS best_writer,
           coalesce(bool_or(c.q_value <= {fdr}), false) AS prev_discovery
    FROM composition_z c JOIN prev_heads p
      ON c.model = p.model AND c.checkpoint = p.checkpoint AND c.writer_layer = p.layer AND c.writer_head = p.head
    GROUP BY ALL)
SELECT b.*, h.prev_token_mean, h.induction_mean, h.ablation_drop, h.induction_mean >= {ind} AS is_induction
FROM best b JOIN head_scores h USING (model, checkpoint, layer, head)"""

# The payoff table: does a metric (in a space, for a comp) pick out the heads that do induction?
# Spearman = Pearson on average ranks; AUROC = Mann-Whitney U / (n_pos n_neg) from the same ranks.
# Discovery precision / recall: of "the reader has a discovery from a previous-token head" for
# "the reader is an induction head".
COMPOSITION_VS_BEHAVIOUR = """CREATE VIEW composition_vs_behaviour AS
WITH ranked AS (
    SELECT *,
      rank() OVER (PARTITION BY model, checkpoint, metric, space, comp ORDER BY best_score)
        + (count(*) OVER (PARTITION BY model, checkpoint, metric, space, comp, best_score) - 1) / 2.0 AS r_score,
      rank() OVER (PARTITION BY model, checkpoint, metric, space, comp ORDER BY induction_mean)
        + (count(*) OVER (PARTITION BY model, checkpoint, metric, space, comp, induction_mean) - 1) / 2.0 AS r_ind,
      rank() OVER (PARTITION BY model, checkpoint, metric, space, comp ORDER BY ablation_drop)
        + (count(*) OVER (PARTITION BY model, checkpoint, metric, space, comp, ablation_drop) - 1) / 2.0 AS r_abl
    FROM reader_best_composition)
SELECT model, checkpoint, metric, space, comp,
    count(*) AS n_readers, count_if(is_induction)::BIGINT AS n_induction_heads,
    corr(r_score, r_ind) AS spearman_induction, corr(r_score, r_abl) AS spearman_ablation,
    (sum(CASE WHEN is_induction THEN r_score ELSE 0 END) - sum(is_induction::INTEGER) * (sum(is_induction::INTEGER) + 1) / 2.0)
      / NULLIF(sum(is_induction::INTEGER) * (count(*) - sum(is_induction::INTEGER)), 0) AS auroc,
    coalesce(any_value(d.n_discoveries), 0)::BIGINT AS n_discoveries,
    count_if(prev_discovery)::BIGINT AS n_readers_with_discovery,
    count_if(prev_discovery AND is_induction) / NULLIF(count_if(prev_discovery), 0) AS discovery_precision,
    count_if(prev_discovery AND is_induction) / NULLIF(count_if(is_induction), 0) AS discovery_recall
FROM ranked LEFT JOIN (SELECT model, checkpoint, metric, space, comp, count(*) AS n_discoveries
                       FROM discoveries GROUP BY ALL) d USING (model, checkpoint, metric, space, comp)
GROUP BY ALL"""

_DUCK_TYPES = {pl.Utf8: "VARCHAR", pl.Int32: "INTEGER", pl.Int64: "BIGINT", pl.Float64: "DOUBLE", pl.Boolean: "BOOLEAN"}


def models_frame(meta_paths: list[str | os.PathLike]) -> pl.DataFrame:
    """The ``models`` table: a row per extraction metadata file (``tables.MODELS_SCHEMA``)."""
    rows: list[dict[str, Any]] = []
    for p in meta_paths:
        meta = json.loads(Path(p).read_text())
        row = {c: meta.get(c) for c in MODELS_SCHEMA}
        row["versions"] = json.dumps(meta.get("versions", {}), sort_keys=True)
        row["quantized"] = bool(meta.get("quantized", False))
        rows.append(row)
    return pl.DataFrame(rows, schema=MODELS_SCHEMA)


def _parquet_view(name: str, shards: list[str | os.PathLike], types: dict, root: Path | None = None) -> str:
    columns = list(types)
    if not shards:  # an empty, typed view keeps queries valid before the first results
        cols = ", ".join(f"NULL::{_DUCK_TYPES[types[c]]} AS {c}" for c in columns)
        return f"CREATE VIEW {name} AS SELECT {cols} WHERE false"

    def where(s) -> str:  # relative to the database's folder when the shard is inside it
        p = Path(s).resolve()
        return p.relative_to(root).as_posix() if root is not None and p.is_relative_to(root) else str(p)

    files = ", ".join("'" + where(s).replace("'", "''") + "'" for s in sorted(map(str, shards)))
    return f"CREATE VIEW {name} AS SELECT {', '.join(columns)} FROM read_parquet([{files}], union_by_name = true)"


def bad_shards(paths: list[str | os.PathLike]) -> dict[str, str]:
    """path -> error for every shard whose Parquet footer does not open (truncated or corrupt)."""
    import pyarrow.parquet as pq

    bad = {}
    for p in paths:
        try:
            pq.read_metadata(p)
        except Exception as e:  # noqa: BLE001 -- pyarrow raises several types for truncated files
            bad[str(p)] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return bad


def connect(db_path: str | os.PathLike, read_only: bool = True) -> duckdb.DuckDBPyConnection:
    """Open the atlas with its shards' relative paths resolved against its own folder."""
    con = duckdb.connect(str(db_path), read_only=read_only)
    folder = str(Path(db_path).resolve().parent).replace("'", "''")
    con.execute(f"SET file_search_path = '{folder}'")
    return con


def build_atlas(db_path: str | os.PathLike, shards: dict[str, list[str | os.PathLike]],
                meta_paths: list[str | os.PathLike], prev_token_threshold: float = 0.4,
                induction_threshold: float = 0.4, fdr: float = 0.05) -> None:
    """(Re)build the atlas database: a view per entry of ``tables.SHARD_VIEWS`` over its shards
    (empty views for the ones with none), then the derived views. Every shard is checked to open
    first, naming any bad one. The thresholds say which heads count as previous-token heads and
    as induction heads in ``composition_vs_behaviour``; ``fdr`` is the q-value cut of ``discoveries``."""
    unknown = set(shards) - set(SHARD_VIEWS)
    if unknown:
        raise ValueError(f"no view is defined for {sorted(unknown)}")
    root = Path(db_path).resolve().parent
    excluded = []
    for view, paths in shards.items():
        for path, error in bad_shards(paths).items():
            log.warning("left out of the %s view: result shard %s is corrupt or truncated (%s); delete it and rerun",
                        view, path, error)
            excluded.append({"view": view, "path": path, "error": error})
    dropped = {e["path"] for e in excluded}
    models = models_frame(meta_paths)
    with atomic_path(db_path) as tmp:
        tmp.unlink()  # duckdb wants to create the file itself
        con = duckdb.connect(str(tmp))
        con.execute(f"SET file_search_path = '{str(root).replace(chr(39), chr(39) * 2)}'")  # views bind here
        try:
            con.register("models_df", models.to_arrow())
            con.execute("CREATE TABLE models AS SELECT * FROM models_df")
            con.register("excluded_df", pl.DataFrame(excluded, schema=EXCLUDED_SHARDS_SCHEMA).to_arrow())
            con.execute("CREATE TABLE excluded_shards AS SELECT * FROM excluded_df")
            for name, types in SHARD_VIEWS.items():
                kept = [p for p in shards.get(name, []) if str(p) not in dropped]
                con.execute(_parquet_view(name, kept, types, root))
            con.execute(CHECKPOINTS)
            con.execute(COMPOSITION_Z)
            con.execute(DISCOVERIES.format(fdr=float(fdr)))
            con.execute(INDUCTION_SUMMARY)
            con.execute(READER_BEST.format(prev=float(prev_token_threshold), ind=float(induction_threshold),
                                           fdr=float(fdr)))
            con.execute(COMPOSITION_VS_BEHAVIOUR)
        finally:
            con.close()
        with atomic_path(last_good_path(db_path)) as keep:  # what queries fall back on (see last_good_path)
            shutil.copyfile(tmp, keep)


def last_good_path(db_path: str | os.PathLike) -> Path:
    """A copy of the last atlas that was built whole, beside it (so its relative shard paths hold).
    Snakemake removes a job's outputs before it runs and after it fails, so while a rebuild runs
    or after it failed there is no ``atlas.duckdb``; ``compatlas query`` then answers from this."""
    p = Path(db_path)
    return p.with_name(f".{p.stem}.last-good{p.suffix}")


def query(db_path: str | os.PathLike, sql: str) -> pl.DataFrame:
    con = connect(db_path)
    try:
        return con.sql(sql).pl()
    finally:
        con.close()
