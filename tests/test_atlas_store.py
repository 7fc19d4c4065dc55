"""The atlas as a store: relocatable (shard paths relative to its folder) and tolerant of a bad
shard (left out with a warning and a row in `excluded_shards`, the others still queryable)."""

from __future__ import annotations

import shutil
from pathlib import Path

import polars as pl

from compatlas.atlas import build_atlas, query
from compatlas.tables import COMPOSITION_SCHEMA
from compatlas.storage import write_shard


def shard(path: Path, model: str, score: float) -> Path:
    row = {c: None for c in COMPOSITION_SCHEMA}
    row.update(model=model, checkpoint="final", processing="none", space="residual", metric="frobenius", comp="K",
               writer_layer=0, writer_head=0, reader_layer=1, reader_head=0, score=score)
    write_shard(pl.DataFrame([row], schema=COMPOSITION_SCHEMA), path, {"model": model})
    return path


def make_results(results: Path) -> dict[str, list[Path]]:
    comp = results / "composition"
    return {"composition": [shard(comp / f"model={m}" / "block=0.parquet", m, s) for m, s in (("a", 0.25), ("b", 0.5))]}


def test_moved_atlas_reads_the_moved_shards(tmp_path: Path):
    old = tmp_path / "old" / "results"
    build_atlas(old / "atlas.duckdb", make_results(old), [])
    new = tmp_path / "elsewhere" / "copy"
    shutil.copytree(old, new)
    shutil.rmtree(tmp_path / "old")  # nothing left at the old place
    got = query(new / "atlas.duckdb", "SELECT model, score FROM composition ORDER BY model")
    assert got.rows() == [("a", 0.25), ("b", 0.5)]


def test_moved_atlas_does_not_read_the_old_shards(tmp_path: Path):
    old = tmp_path / "old" / "results"
    build_atlas(old / "atlas.duckdb", make_results(old), [])
    new = tmp_path / "new" / "results"
    shutil.copytree(old, new)
    shard(old / "composition" / "model=a" / "block=0.parquet", "a", 0.75)  # the old place changes
    got = query(new / "atlas.duckdb", "SELECT score FROM composition WHERE model = 'a'")
    assert got["score"].to_list() == [0.25]


def test_truncated_shard_is_left_out_and_named(tmp_path: Path, caplog):
    results = tmp_path / "results"
    shards = make_results(results)
    bad = shards["composition"][1]
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    build_atlas(results / "atlas.duckdb", shards, [])
    assert str(bad) in caplog.text and "corrupt or truncated" in caplog.text
    assert query(results / "atlas.duckdb", "SELECT model FROM composition").rows() == [("a",)]
    excluded = query(results / "atlas.duckdb", "SELECT view, path FROM excluded_shards")
    assert excluded.rows() == [("composition", str(bad))]


def test_query_falls_back_on_the_last_good_atlas(tmp_path: Path, capsys):
    from compatlas import cli

    results = tmp_path / "results"
    build_atlas(results / "atlas.duckdb", make_results(results), [])
    (results / "atlas.duckdb").unlink()  # what Snakemake does to the output of a failed rebuild
    rc = cli.main(["query", "--db", str(results / "atlas.duckdb"), "--format", "csv",
                   "SELECT model FROM composition ORDER BY model"])
    out = capsys.readouterr()
    assert rc == 0 and out.out.splitlines() == ["model", "a", "b"]
    assert "answering from the last good atlas" in out.err
