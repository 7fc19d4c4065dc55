"""compatlas.tables: the atlas's views have exactly the writers' schemas, and every shard's
provenance record carries the same keys, whichever writer made it."""

from __future__ import annotations

import polars as pl

from compatlas import tables
from compatlas.atlas import build_atlas, connect
from compatlas.function.comp_agreement import agreement_tables

DUCK = {pl.Utf8: "VARCHAR", pl.Int32: "INTEGER", pl.Int64: "BIGINT", pl.Float64: "DOUBLE", pl.Boolean: "BOOLEAN"}


def test_empty_atlas_views_have_the_schemas_columns_in_order(tmp_path):
    db = tmp_path / "atlas.duckdb"
    build_atlas(db, {}, [], computed=agreement_tables)  # as scripts/atlas.py builds it
    con = connect(db)
    try:
        for view, schema in tables.SHARD_VIEWS.items():
            got = con.execute(f"DESCRIBE {view}").fetchall()
            # and `latest` (the checkpoints view's flag) last, where the view has a checkpoint
            latest = [("latest", "BOOLEAN")] if "checkpoint" in schema else []
            assert [(c, t) for c, t, *_ in got] == [(c, DUCK[t]) for c, t in schema.items()] + latest, view
        models = [c for c, *_ in con.execute("DESCRIBE models").fetchall()]
        assert models == list(tables.MODELS_SCHEMA)
        agreement = [c for c, *_ in con.execute("DESCRIBE function_agreement").fetchall()]
        assert agreement == [*tables.FUNCTION_AGREEMENT_SCHEMA, "latest"]
        bootstrap = [(c, t) for c, t, *_ in con.execute("DESCRIBE function_bootstrap").fetchall()]
        assert bootstrap == [*((c, "DOUBLE[]" if c.endswith("_boot") else DUCK[t])
                               for c, t in tables.FUNCTION_BOOTSTRAP_SCHEMA.items()), ("latest", "BOOLEAN")]
    finally:
        con.close()


def test_provenance_has_the_model_keys_versions_and_the_writers_facts():
    meta = {"model": "m", "checkpoint": "step5", "checkpoint_step": 5, "processing": "compat", "source_kind": "hub",
            "weights_sha256": "ab", "n_layers": 4, "versions": {"torch": "0.0"}}
    record = tables.provenance(meta, metric="frobenius", processing="none")
    assert set(record) == set(tables.MODEL_PROVENANCE) | {"versions", "metric"}
    assert record["model"] == "m" and record["checkpoint_step"] == 5 and record["source_commit"] is None
    assert record["processing"] == "none"  # a writer's fact wins over the metadata
    assert "n_layers" not in record  # only the keys that identify the weights
    assert record["versions"]["polars"] == pl.__version__  # the writing process's, not the extraction's
    assert set(tables.provenance(None, seed=0)) == {"versions", "seed"}  # a table of no model
