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

COMPOSITION_COLUMNS = list(SCHEMA)
MODEL_COLUMNS = ["model", "checkpoint", "checkpoint_step", "checkpoint_tokens", "architecture", "hf_architecture",
                 "n_layers", "n_heads", "n_kv_heads", "d_model", "d_head", "d_vocab", "norm_type", "tied_embeddings",
                 "has_unembed", "processing", "quantized", "source_kind", "source_name", "source_path",
                 "source_checksum", "weights_sha256", "versions"]

_DUCK_TYPES = {pl.Utf8: "VARCHAR", pl.Int32: "INTEGER", pl.Float64: "DOUBLE"}


def models_frame(meta_paths: list[str | os.PathLike]) -> pl.DataFrame:
    rows: list[dict[str, Any]] = []
    for p in meta_paths:
        meta = json.loads(Path(p).read_text())
        row = {c: meta.get(c) for c in MODEL_COLUMNS}
        row["versions"] = json.dumps(meta.get("versions", {}), sort_keys=True)
        row["quantized"] = bool(meta.get("quantized", False))
        rows.append(row)
    schema = {c: pl.Utf8 for c in MODEL_COLUMNS} | {c: pl.Int64 for c in ("checkpoint_step", "checkpoint_tokens", "n_layers", "n_heads", "n_kv_heads", "d_model", "d_head", "d_vocab")} | {"tied_embeddings": pl.Boolean, "has_unembed": pl.Boolean, "quantized": pl.Boolean}
    return pl.DataFrame(rows, schema=schema)


def _parquet_view(name: str, shards: list[str | os.PathLike], columns: list[str], types: dict) -> str:
    if not shards:  # an empty, typed view keeps queries valid before the first results
        cols = ", ".join(f"NULL::{_DUCK_TYPES[types[c]]} AS {c}" for c in columns)
        return f"CREATE VIEW {name} AS SELECT {cols} WHERE false"
    files = ", ".join("'" + str(Path(s).resolve()).replace("'", "''") + "'" for s in sorted(map(str, shards)))
    return f"CREATE VIEW {name} AS SELECT {', '.join(columns)} FROM read_parquet([{files}], union_by_name = true)"


def build_atlas(db_path: str | os.PathLike, composition_shards: list[str | os.PathLike],
                meta_paths: list[str | os.PathLike]) -> None:
    """(Re)build the atlas database; every shard is checked to open first, naming any bad one."""
    check_shards(composition_shards)
    models = models_frame(meta_paths)
    with atomic_path(db_path) as tmp:
        tmp.unlink()  # duckdb wants to create the file itself
        con = duckdb.connect(str(tmp))
        try:
            con.register("models_df", models.to_arrow())
            con.execute("CREATE TABLE models AS SELECT * FROM models_df")
            con.execute(_parquet_view("composition", composition_shards, COMPOSITION_COLUMNS, SCHEMA))
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
