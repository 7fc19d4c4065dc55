"""The DuckDB atlas: views over the Parquet shards, and the extraction metadata as `models`.

Rebuilding is cheap (no data is copied): the views read the shards in place. The file is
built under a temporary name and renamed, so readers never see a half-built database.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import duckdb
import polars as pl

from compatlas.scores import SCHEMA
from compatlas.storage import atomic_path, check_shards

MODEL_COLUMNS = ["model", "checkpoint", "checkpoint_step", "checkpoint_tokens", "architecture", "hf_architecture",
                 "n_layers", "n_heads", "n_kv_heads", "d_model", "d_head", "d_vocab", "norm_type", "tied_embeddings",
                 "has_unembed", "token_condition", "token_norm_condition", "processing", "quantized", "source_kind", "source_name", "source_path",
                 "source_checksum", "weights_sha256", "versions"]

INVARIANCE_SCHEMA = {"model": pl.Utf8, "checkpoint": pl.Utf8, "processing": pl.Utf8, "transform": pl.Utf8,
                     "metric": pl.Utf8, "space": pl.Utf8, "comp": pl.Utf8, "spearman": pl.Float64,
                     "max_abs_change": pl.Float64, "top_k": pl.Int64, "top_k_overlap": pl.Float64,
                     "top_k_kept": pl.Boolean, "log10_scale_range": pl.Float64}
AUDIT_SCHEMA = {"metric": pl.Utf8, "space": pl.Utf8, "axiom": pl.Utf8, "construction": pl.Utf8, "value": pl.Float64,
                "expected": pl.Float64, "passed": pl.Boolean, "detail": pl.Utf8}
VIEWS = {"composition": SCHEMA, "invariance": INVARIANCE_SCHEMA, "metric_audit": AUDIT_SCHEMA}

_DUCK_TYPES = {pl.Utf8: "VARCHAR", pl.Int32: "INTEGER", pl.Int64: "BIGINT", pl.Float64: "DOUBLE", pl.Boolean: "BOOLEAN"}


def models_frame(meta_paths: list[str | os.PathLike]) -> pl.DataFrame:
    rows: list[dict[str, Any]] = []
    for p in meta_paths:
        meta = json.loads(Path(p).read_text())
        row = {c: meta.get(c) for c in MODEL_COLUMNS}
        row["versions"] = json.dumps(meta.get("versions", {}), sort_keys=True)
        row["quantized"] = bool(meta.get("quantized", False))
        rows.append(row)
    schema = {c: pl.Utf8 for c in MODEL_COLUMNS} | {c: pl.Int64 for c in ("checkpoint_step", "checkpoint_tokens", "n_layers", "n_heads", "n_kv_heads", "d_model", "d_head", "d_vocab")} | {"token_condition": pl.Float64, "token_norm_condition": pl.Float64, "tied_embeddings": pl.Boolean, "has_unembed": pl.Boolean, "quantized": pl.Boolean}
    return pl.DataFrame(rows, schema=schema)


def _parquet_view(name: str, shards: list[str | os.PathLike], types: dict) -> str:
    columns = list(types)
    if not shards:  # an empty, typed view keeps queries valid before the first results
        cols = ", ".join(f"NULL::{_DUCK_TYPES[types[c]]} AS {c}" for c in columns)
        return f"CREATE VIEW {name} AS SELECT {cols} WHERE false"
    files = ", ".join("'" + str(Path(s).resolve()).replace("'", "''") + "'" for s in sorted(map(str, shards)))
    return f"CREATE VIEW {name} AS SELECT {', '.join(columns)} FROM read_parquet([{files}], union_by_name = true)"


def build_atlas(db_path: str | os.PathLike, shards: dict[str, list[str | os.PathLike]],
                meta_paths: list[str | os.PathLike]) -> None:
    """(Re)build the atlas database: a view per entry of VIEWS over its shards (empty views for
    the ones with none). Every shard is checked to open first, naming any bad one."""
    unknown = set(shards) - set(VIEWS)
    if unknown:
        raise ValueError(f"no view is defined for {sorted(unknown)}")
    for paths in shards.values():
        check_shards(paths)
    models = models_frame(meta_paths)
    with atomic_path(db_path) as tmp:
        tmp.unlink()  # duckdb wants to create the file itself
        con = duckdb.connect(str(tmp))
        try:
            con.register("models_df", models.to_arrow())
            con.execute("CREATE TABLE models AS SELECT * FROM models_df")
            for name, types in VIEWS.items():
                con.execute(_parquet_view(name, shards.get(name, []), types))
            con.execute("""CREATE VIEW composition_z AS SELECT *,
                score - baseline_gaussian_mean AS score_minus_gaussian,
                (score - baseline_spectrum_mean) / NULLIF(baseline_spectrum_std, 0) AS z_spectrum,
                (score - baseline_gaussian_mean) / NULLIF(baseline_gaussian_std, 0) AS z_gaussian
                FROM composition""")
        finally:
            con.close()


def query(db_path: str | os.PathLike, sql: str) -> pl.DataFrame:
    con = duckdb.connect(str(db_path), read_only=True)
    try:
        return con.sql(sql).pl()
    finally:
        con.close()
