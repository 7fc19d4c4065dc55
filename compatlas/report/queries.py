"""Every query the report makes of the atlas (read-only DuckDB), each returning a polars frame.

Queries are per model (and mostly per model's last checkpoint), so the report's cost grows with
the number of models, not with checkpoints x metrics x spaces; the views over the shards push
the model and checkpoint filters down into the Parquet scans. Views or columns that an older
atlas lacks give empty frames, and the sections say so.
"""

from __future__ import annotations

import re
from typing import Any

import duckdb
import polars as pl

from compatlas.vocab import COMPS, EDGE_METHODS

Con = duckdb.DuckDBPyConnection
EDGE_MAX = 150  # the circuit view draws at most this many discoveries per metric x space (smallest q first)
STRONGEST_PER_COMP = 10  # where there are no discoveries: the smallest-p pairs drawn per metric x space x comp
WHERE = "model = ? AND checkpoint = ?"
KEYS = "metric, space, comp, writer_layer, writer_head, reader_layer, reader_head"  # a pair's, in a model x checkpoint


def columns(con: Con, view: str) -> set[str]:
    """A view's or table's columns, from the catalog (binding a view over a thousand shards to
    ask costs a quarter of a second)."""
    try:
        cols = {r[0] for r in con.execute("SELECT column_name FROM duckdb_columns() WHERE table_name = ?",
                                          [view]).fetchall()}
        if cols:
            return cols
        return {d[0] for d in con.execute(f"SELECT * FROM {view} LIMIT 0").description}
    except duckdb.Error:
        return set()


def has(con: Con, view: str, *cols: str) -> bool:
    return bool(c := columns(con, view)) and set(cols) <= c


def _pl(con: Con, sql: str, params: list[Any] | None = None) -> pl.DataFrame:
    return con.sql(sql, params=params or None).pl()


def fdr(con: Con) -> float | None:
    """The q-value cut of the ``discoveries`` view, read from its definition."""
    try:
        row = con.execute("SELECT sql FROM duckdb_views() WHERE view_name = 'discoveries'").fetchone()
    except duckdb.Error:
        return None
    m = re.search(r"q_value\s*<=\s*([0-9.eE+-]+)", row[0]) if row else None
    return float(m.group(1)) if m else None


def checkpoints(con: Con) -> pl.DataFrame:
    """One row per model x checkpoint of the models table, in step order, with ``latest`` (the
    last checkpoint of its model) and the model's number of checkpoints."""
    if not has(con, "models", "model", "checkpoint"):
        return pl.DataFrame(schema={"model": pl.Utf8, "checkpoint": pl.Utf8, "checkpoint_step": pl.Int64})
    df = _pl(con, "SELECT * FROM models")
    if "checkpoint_step" not in df.columns:  # atlases built before checkpoint steps were recorded
        df = df.with_columns(checkpoint_step=pl.lit(None, pl.Int64))
    df = df.sort(["model", "checkpoint_step", "checkpoint"], nulls_last=True)
    return df.with_columns(latest=pl.int_range(pl.len()).over("model") == pl.len().over("model") - 1,
                           n_checkpoints=pl.len().over("model"))


def _calibrated(con: Con) -> tuple[str, str]:
    """The view to read scores from and its p/q columns (null where the atlas has no calibration)."""
    if has(con, "composition_z", "p_value", "q_value", "n_null"):
        return "composition_z", "n_null, p_value, q_value"
    return "composition", "NULL::BIGINT AS n_null, NULL::DOUBLE AS p_value, NULL::DOUBLE AS q_value"


def pairs(con: Con, model: str, checkpoint: str, metric: str, space: str) -> pl.DataFrame:
    """Every head pair of one model x checkpoint x metric x space, with its nulls and p, q."""
    view, pq = _calibrated(con)
    return _pl(con, f"""SELECT comp, writer_layer, writer_head, reader_layer, reader_head, score,
                           baseline_gaussian_mean, baseline_spectrum_mean, baseline_spectrum_std, {pq}
                        FROM {view} WHERE model = ? AND checkpoint = ? AND metric = ? AND space = ?""",
               [model, checkpoint, metric, space])


def heatmap_blocks(con: Con, model: str, checkpoint: str, metric: str, space: str, q_cut: float | None) -> pl.DataFrame:
    """The heatmap of a model too large for a cell per head pair, aggregated in DuckDB: one row
    per comp x writer layer x reader layer with the block's strongest pair (smallest p, then
    largest score; largest score where the atlas has no calibration), its score, nulls, p and q,
    and the block's pairs and discoveries. Two scans (the p-values, then the scores of each
    block's smallest-p pairs only), never a join of the pairs with their p-values."""
    where = "model = ? AND checkpoint = ? AND metric = ? AND space = ?"
    args = [model, checkpoint, metric, space]
    keys = "comp, writer_layer, writer_head, reader_layer, reader_head"
    cols = "score, baseline_spectrum_mean, baseline_spectrum_std, baseline_gaussian_mean"
    if not has(con, "calibration", "p_value", "q_value"):
        return _pl(con, f"""SELECT comp, writer_layer, reader_layer, count(*) AS pairs, NULL::BIGINT AS discoveries,
                                   arg_max(writer_head, score) AS writer_head, arg_max(reader_head, score) AS reader_head,
                                   max(score) AS score, arg_max(baseline_spectrum_mean, score) AS baseline_spectrum_mean,
                                   arg_max(baseline_spectrum_std, score) AS baseline_spectrum_std,
                                   arg_max(baseline_gaussian_mean, score) AS baseline_gaussian_mean,
                                   NULL::BIGINT AS n_null, NULL::DOUBLE AS p_value, NULL::DOUBLE AS q_value
                            FROM composition WHERE {where} GROUP BY ALL""", args)
    cut = float(q_cut) if q_cut is not None else -1.0
    return _pl(con, f"""
        WITH blocks AS (SELECT comp, writer_layer, reader_layer, count(*) AS pairs, min(p_value) AS block_p,
                          count(DISTINCT {test_key(con)}) FILTER (WHERE q_value <= {cut})::BIGINT AS discoveries
                   FROM calibration WHERE {where} GROUP BY ALL),
        best AS (SELECT {', '.join('c.' + k.strip() for k in keys.split(','))}, c.n_null, c.p_value, c.q_value
                 FROM (SELECT * FROM calibration WHERE {where}) c
                 JOIN blocks b ON c.comp = b.comp AND c.writer_layer = b.writer_layer
                      AND c.reader_layer = b.reader_layer AND c.p_value = b.block_p),
        scored AS (SELECT b.*, {', '.join('c.' + x.strip() for x in cols.split(','))}
                   FROM best b JOIN (SELECT {keys}, {cols} FROM composition WHERE {where}) c USING ({keys})
                   QUALIFY row_number() OVER (PARTITION BY comp, writer_layer, reader_layer ORDER BY c.score DESC) = 1)
        SELECT * EXCLUDE (block_p) FROM blocks JOIN scored USING (comp, writer_layer, reader_layer)
        ORDER BY comp, writer_layer, reader_layer""", args * 3)


def test_key(con: Con) -> str:
    """SQL naming a calibration row's test: in a grouped-query model a KV head's test
    (``test_unit = 'kv_head'``) is one test whatever the query head, so counts count it once."""
    if "test_unit" not in columns(con, "calibration"):
        return "(writer_layer, writer_head, reader_layer, reader_head)"
    return ("(writer_layer, writer_head, reader_layer, CASE WHEN test_unit = 'kv_head' THEN -1 - reader_kv_head "
            "ELSE reader_head END)")


def calibration_summary(con: Con, model: str, checkpoint: str, q_cut: float | None) -> pl.DataFrame:
    """Per metric x space x comp: pairs, discoveries, mean score and nulls, null pairs. Two
    aggregations (scores, p-values) joined when small: joining the pairs first costs seconds."""
    if not has(con, "composition", "score"):
        return pl.DataFrame()
    keys = ["metric", "space", "comp"]
    scores = _pl(con, """SELECT metric, space, comp, count(*) AS pairs, avg(score) AS mean_score,
                                avg(baseline_gaussian_mean) AS gaussian_null, avg(baseline_spectrum_mean) AS spectrum_null
                         FROM composition WHERE model = ? AND checkpoint = ? GROUP BY ALL""", [model, checkpoint])
    if q_cut is None or not has(con, "calibration", "q_value", "n_null"):
        return scores.with_columns(discoveries=pl.lit(None, pl.Int64), n_null=pl.lit(None, pl.Int64))
    # the discoveries filtered in WHERE, then counted: a DISTINCT under FILTER hashes every row
    # (a 70B model's 349M p-values: 210 s against 9 s this way)
    n_null = _pl(con, """SELECT metric, space, comp, max(n_null)::BIGINT AS n_null FROM calibration
                         WHERE model = ? AND checkpoint = ? GROUP BY ALL""", [model, checkpoint])
    found = _pl(con, f"""SELECT metric, space, comp, count(DISTINCT {test_key(con)})::BIGINT AS discoveries
                         FROM calibration WHERE model = ? AND checkpoint = ? AND q_value <= {float(q_cut)}
                         GROUP BY ALL""", [model, checkpoint])
    cal = n_null.join(found, on=keys, how="left").with_columns(pl.col("discoveries").fill_null(0))
    return scores.join(cal, on=keys, how="left")


def strongest(con: Con, model: str, checkpoint: str, limit: int = STRONGEST_PER_COMP,
              metrics: list[str] | None = None, by: str = "p") -> pl.DataFrame:
    """Where nothing is a discovery: the ``limit`` tests per metric x space x comp with the smallest p (ties, as at
    the null's floor: the largest z), every query head of each (a KV head's test is its query heads' rows), in the
    columns of ``discoveries``. Per comp, not pooled: pooled, one comp's smallest p (toy-llama-gqa's Q and K) took
    every place and left another comp's panel empty; per test: a KV head's four rows took four. ``by="score"``: the largest scores."""
    if not has(con, "calibration", "p_value") or not has(con, "composition", "score"):
        return pl.DataFrame()
    only = "" if metrics is None else f" AND metric IN ({', '.join(repr(str(m)) for m in metrics) or 'NULL'})"
    order, tests = ("p_value", "qt, pt, zt DESC NULLS LAST") if by == "p" else ("score DESC", "st DESC")  # a test: one rank
    top = f"QUALIFY dense_rank() OVER (PARTITION BY metric, space, comp ORDER BY {order}) <= {int(limit)}"
    sql = f"SELECT * FROM calibration WHERE model = ? AND checkpoint = ?{only}"
    if by != "p":  # the calibration rows of the composition's largest scores
        sql = f"SELECT * FROM ({sql}) c SEMI JOIN (SELECT * FROM composition WHERE {WHERE}{only} {top}) t USING ({KEYS})"
    return _ranked(con, model, checkpoint, sql if by != "p" else f"{sql} {top}", limit, by=("metric", "space", "comp"),
                   per_test=tests, args=[] if by == "p" else [model, checkpoint])


def _ranked(con: Con, model: str, checkpoint: str, cal_sql: str, limit: int,
            by: tuple[str, ...] = ("metric", "space"), per_test: str = "", args: list[Any] | None = None) -> pl.DataFrame:
    """The p-values chosen by ``cal_sql`` joined to their scores, at most ``limit`` rows per ``by``
    (a metric x space, or a metric x space x comp), or with ``per_test`` (their order, by a test's
    q, p, z and score: qt, pt, zt, st) ``limit`` tests, each with all its rows (queries.test_key)."""
    k = KEYS
    unit = ", test_unit, reader_kv_head" if "test_unit" in columns(con, "calibration") else ""
    part = ", ".join(by)
    test = test_key(con)
    # per test: its rows share one rank, by the test's q, p and largest z, or score (then by the test: its rows together)
    rank = (f"dense_rank() OVER (PARTITION BY {part} ORDER BY {per_test}, {test})"
            if per_test else f"row_number() OVER (PARTITION BY {part} ORDER BY q_value, p_value, z_spectrum DESC)")
    return _pl(con, f"""WITH d AS (SELECT {k}{unit}, n_null, p_value, q_value FROM ({cal_sql})),
        s AS (SELECT d.*, c.score, c.baseline_spectrum_mean, c.baseline_spectrum_std,
                     (c.score - c.baseline_spectrum_mean) / NULLIF(c.baseline_spectrum_std, 0) AS z_spectrum
              FROM d JOIN (SELECT * FROM composition WHERE model = ? AND checkpoint = ?) c USING ({k})),
        t AS (SELECT *, min(q_value) OVER w AS qt, min(p_value) OVER w AS pt, max(z_spectrum) OVER w AS zt,
              max(score) OVER w AS st FROM s WINDOW w AS (PARTITION BY {part}, {test}))
        SELECT * EXCLUDE (qt, pt, zt, st) FROM (SELECT *, count(DISTINCT {test}) OVER (PARTITION BY metric, space) AS n_total,
                                               {rank} AS rank
                                        FROM t) WHERE rank <= {int(limit)}
        ORDER BY metric, space, comp, rank, writer_layer, writer_head, reader_layer, reader_head""",
               [*(args or []), model, checkpoint, model, checkpoint])  # ordered: a page is the same every build


def discoveries(con: Con, model: str, checkpoint: str, q_cut: float | None, limit: int = EDGE_MAX) -> pl.DataFrame:
    """The discoveries of one model x checkpoint, at most ``limit`` per metric x space (smallest
    q, then largest score), with ``n_total`` (how many there are in that metric x space). The
    p-values are filtered first, then joined to their scores."""
    if q_cut is None or not has(con, "calibration", "q_value") or not has(con, "composition", "score"):
        return pl.DataFrame()
    return _ranked(con, model, checkpoint, f"""SELECT * FROM calibration WHERE model = ? AND checkpoint = ?
                   AND q_value <= {float(q_cut)}""", limit)


def circuit_edges(con: Con, model: str, checkpoint: str, q_cut: float | None, writers: list[tuple[int, int]],
                  readers: list[tuple[int, int]]) -> pl.DataFrame:
    """The K-composition discoveries of one model x checkpoint (every metric x space) from one of
    ``writers`` (layer, head: the previous-token heads) into one of ``readers`` (the induction
    heads): metric, space, the heads, ``test`` (the test it belongs to, ``test_key``: a KV head's
    shared test counts once) and q. At most writers x readers rows per metric x space."""
    cols = ["metric", "space", "writer_layer", "writer_head", "reader_layer", "reader_head", "test", "q_value"]
    if q_cut is None or not writers or not readers or not has(con, "calibration", "q_value"):
        return pl.DataFrame(schema=dict.fromkeys(cols, pl.Utf8) | {c: pl.Int64 for c in cols[2:6]} | {"q_value": pl.Float64})

    def values(heads: list[tuple[int, int]]) -> str:  # integers only: safe inline
        return ", ".join(f"({int(layer)}, {int(h)})" for layer, h in heads)

    return _pl(con, f"""SELECT metric, space, writer_layer::BIGINT AS writer_layer, writer_head::BIGINT AS writer_head,
                               reader_layer::BIGINT AS reader_layer, reader_head::BIGINT AS reader_head,
                               {test_key(con)}::VARCHAR AS test, q_value
                        FROM calibration
                        JOIN (VALUES {values(writers)}) w(wl, wh) ON writer_layer = w.wl AND writer_head = w.wh
                        JOIN (VALUES {values(readers)}) r(rl, rh) ON reader_layer = r.rl AND reader_head = r.rh
                        WHERE model = ? AND checkpoint = ? AND comp = 'K' AND q_value <= {float(q_cut)}
                        ORDER BY metric, space, writer_layer, writer_head, reader_layer, reader_head""",
               [model, checkpoint])


def depth_profile(con: Con, model: str, checkpoint: str, metric: str, space: str, q_cut: float) -> pl.DataFrame:
    """Per comp and reader layer: head pairs writing into it and how many are discoveries."""
    if not has(con, "calibration", "q_value"):
        return pl.DataFrame()
    return _pl(con, f"""SELECT comp, reader_layer, count(*) AS pairs,
                               count(DISTINCT {test_key(con)}) FILTER (WHERE q_value <= {float(q_cut)})::BIGINT AS n
                        FROM calibration WHERE model = ? AND checkpoint = ? AND metric = ? AND space = ?
                        GROUP BY ALL ORDER BY comp, reader_layer""", [model, checkpoint, metric, space])


def threshold(con: Con, pattern: str, default: float) -> float:
    """A head-score threshold the atlas was built with, read from reader_best_composition's definition."""
    try:
        row = con.execute("SELECT sql FROM duckdb_views() WHERE view_name = 'reader_best_composition'").fetchone()
    except duckdb.Error:
        return default
    m = re.search(pattern + r"\s*>=\s*([0-9.eE+-]+)", row[0]) if row else None
    return float(m.group(1)) if m else default


def rows(con: Con, view: str, model: str, checkpoint: str | None = None) -> pl.DataFrame:
    """All rows of a per-model view, for one checkpoint or (None) every one, in the order of their
    columns (ORDER BY ALL): a page drawn from them is the same every build."""
    if not has(con, view, "model"):
        return pl.DataFrame()
    if checkpoint is None:
        return _pl(con, f"SELECT * FROM {view} WHERE model = ? ORDER BY ALL", [model])
    return _pl(con, f"SELECT * FROM {view} WHERE model = ? AND checkpoint = ? ORDER BY ALL", [model, checkpoint])


def head_scores_over_training(con: Con, model: str, steps: pl.DataFrame) -> pl.DataFrame:
    """head_scores at every checkpoint of ``model`` with its ``step`` (from ``steps``: checkpoint,
    checkpoint_step); empty without head scores."""
    heads = rows(con, "head_scores", model)
    if heads.is_empty():
        return heads
    st = steps.select("checkpoint", pl.col("checkpoint_step").alias("step"))
    # every key in the sort: rows tied on step came out of the join in either order, and so did the chart's data
    return heads.join(st, on="checkpoint", how="inner").filter(pl.col("step").is_not_null()).sort(
        ["step", *(k for k in ("layer", "head") if k in heads.columns)], maintain_order=True)


def loss(con: Con, model: str) -> pl.DataFrame:
    if not has(con, "training_loss", "step", "loss"):
        return pl.DataFrame(schema={"step": pl.Int64, "loss": pl.Float64})
    return _pl(con, "SELECT step, loss FROM training_loss WHERE model = ? ORDER BY step", [model])


def pair_curves(con: Con, model: str, pair: tuple[tuple[int, int], tuple[int, int]], steps: pl.DataFrame) -> pl.DataFrame:
    """The composition of the previous-token head into the induction head of ``pair`` at every
    checkpoint: metric, space, comp, step, score (and p, q where calibrated)."""
    (il, ih), (pl_, ph) = pair
    if not has(con, "composition", "score"):
        return pl.DataFrame()
    where = "model = ? AND writer_layer = ? AND writer_head = ? AND reader_layer = ? AND reader_head = ?"
    args = [model, pl_, ph, il, ih]
    keys = [k for k in ("checkpoint", "processing", "metric", "space", "comp") if k in columns(con, "composition")]
    # scores and p-values fetched apart and joined here: a join of the views scans every checkpoint twice over
    df = _pl(con, f"SELECT {', '.join(keys)}, score FROM composition WHERE {where}", args)
    if has(con, "calibration", "p_value", "q_value", *keys):
        pq = _pl(con, f"SELECT {', '.join(keys)}, p_value, q_value FROM calibration WHERE {where}", args)
        df = df.join(pq, on=keys, how="left")
    else:
        df = df.with_columns(p_value=pl.lit(None, pl.Float64), q_value=pl.lit(None, pl.Float64))
    st = steps.select("checkpoint", pl.col("checkpoint_step").alias("step"))
    # every key in the sort: DuckDB returns the rows in any order, and a chart drawn from them differed between builds
    return df.join(st, on="checkpoint").drop("checkpoint", "processing", strict=False).sort(
        ["step", *(k for k in ("metric", "space", "comp") if k in keys)], maintain_order=True)


def metric_audit(con: Con) -> pl.DataFrame:
    return _pl(con, "SELECT * FROM metric_audit") if has(con, "metric_audit", "axiom") else pl.DataFrame()


# -- composition against function (edge attribution; docs/edge_attribution.md) --------------------

def edge_methods(con: Con, model: str, checkpoint: str) -> dict[str, str] | None:
    """The attribution method the report shows per comp for a model x checkpoint: the one that
    agrees best with exact patching on that comp (``eap_vs_exact``): its top edge the exact one
    first, then the higher Spearman; ties, and atlases without exact patching, go to the first
    in ``EDGE_METHODS`` order (EAP). Spearmans equal to 12 decimals tie: two equal but for their
    last bits come out of the view in either order from one build to the next (DuckDB sums in any
    order), and a method chosen by that noise changed the page between two runs of the same
    commit. None where the atlas has no composition_vs_function rows."""
    if not has(con, "composition_vs_function", "method", "auroc"):
        return None
    found = {r[0] for r in con.execute("""SELECT DISTINCT method FROM composition_vs_function
                                          WHERE model = ? AND checkpoint = ?""", [model, checkpoint]).fetchall()}
    if not found:
        return None
    methods = [m for m in EDGE_METHODS if m in found] + sorted(found - set(EDGE_METHODS))
    fit: dict[tuple[str, str], tuple[bool, float]] = {}
    if has(con, "eap_vs_exact", "method", "comp", "top_edge_agrees", "spearman"):
        fit = {(m, c): (bool(a), -1.0 if s is None or s != s else round(s, 12)) for m, c, a, s in con.execute(
            """SELECT method, comp, top_edge_agrees, spearman FROM eap_vs_exact WHERE model = ? AND checkpoint = ?""",
            [model, checkpoint]).fetchall()}
    # max keeps the first of equals: EAP wins ties
    return {c: max(methods, key=lambda m: fit.get((m, c), (False, -1.0))) for c in COMPS}


def composition_vs_function(con: Con, model: str, checkpoint: str, methods: str | dict[str, str]) -> pl.DataFrame:
    """composition_vs_function of one model x checkpoint, each comp's rows by its method (one for all, or comp -> method)."""
    per_comp = {c: methods for c in COMPS} if isinstance(methods, str) else methods
    pairs = " OR ".join("(comp = ? AND method = ?)" for _ in per_comp)
    return _pl(con, f"SELECT * FROM composition_vs_function WHERE model = ? AND checkpoint = ? AND ({pairs})",
               [model, checkpoint, *(x for cm in per_comp.items() for x in cm)])


def eap_vs_exact(con: Con, model: str, checkpoint: str) -> pl.DataFrame:
    if not has(con, "eap_vs_exact", "method", "spearman"):
        return pl.DataFrame()
    return _pl(con, "SELECT * FROM eap_vs_exact WHERE model = ? AND checkpoint = ? ORDER BY method, comp",
               [model, checkpoint])


def edge_scatter(con: Con, model: str, checkpoint: str, method: str, metric: str, space: str,
                 comp: str = "K") -> pl.DataFrame:
    """Every causal edge of one comp: its attribution and composition score, one row per query
    head (a K/V edge's attribution repeats on its KV group's query heads; ``function.edge_points``
    folds them as composition_vs_function does)."""
    if not has(con, "edge_attribution", "reader_kv_head", "score") or not has(con, "composition", "score"):
        return pl.DataFrame()
    k = "comp, writer_layer, writer_head, reader_layer, reader_head"
    return _pl(con, f"""SELECT e.writer_layer, e.writer_head, e.reader_layer, e.reader_head, e.reader_kv_head,
                               e.score AS attribution, e.score_stderr AS attribution_stderr, c.score
                        FROM (SELECT * FROM edge_attribution WHERE model = ? AND checkpoint = ? AND method = ?
                              AND comp = ?) e
                        JOIN (SELECT {k}, score FROM composition WHERE model = ? AND checkpoint = ? AND metric = ?
                              AND space = ? AND comp = ?) c USING ({k})""",
               [model, checkpoint, method, comp, model, checkpoint, metric, space, comp])


def top_exact_edge(con: Con, model: str, checkpoint: str, comp: str = "K") -> tuple[tuple[int, int], tuple[int, int]] | None:
    """(writer, reader query head) of the edge with the largest |exact patching| of one comp at a
    checkpoint; None where nothing was patched there."""
    if not has(con, "edge_attribution", "exact"):
        return None
    row = con.execute("""SELECT writer_layer, writer_head, reader_layer, reader_head FROM edge_attribution
                         WHERE model = ? AND checkpoint = ? AND comp = ? AND exact IS NOT NULL AND NOT isnan(exact)
                         ORDER BY abs(exact) DESC, writer_layer, writer_head, reader_layer, reader_head LIMIT 1""",
                      [model, checkpoint, comp]).fetchone()
    return None if row is None else ((int(row[0]), int(row[1])), (int(row[2]), int(row[3])))


def edge_over_training_all(con: Con, model: str, writer: tuple[int, int], reader: tuple[int, int],
                           comp: str = "K") -> pl.DataFrame:
    """One edge at every checkpoint that has it: each method's attribution and standard error,
    and its exact patching (the same in every method's row) where measured."""
    if not has(con, "edge_attribution", "score", "score_stderr", "exact", "exact_stderr"):
        return pl.DataFrame()
    return _pl(con, """SELECT checkpoint, method, score AS attribution, score_stderr AS attribution_stderr, exact, exact_stderr
                       FROM edge_attribution WHERE model = ? AND comp = ? AND writer_layer = ? AND writer_head = ?
                       AND reader_layer = ? AND reader_head = ? ORDER BY checkpoint, method""",
               [model, comp, *writer, *reader])
