"""Faults on the atlas and its shards, without running the pipeline (seconds): every write a
query could make, a crashed read-write session's WAL, a read-write holder across a rebuild,
60 byte flips in a score column, a truncated or vanished shard, the report's notice, duplicate
config keys, blocks beyond the tiles of the layer grid, leftover temp files, a full disk. Each ends with the
clean numbers or a one-line error naming the file. The same faults through Snakemake on the toy
models: tests/test_faults_pipeline.py (slow)."""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from compatlas import cli
from compatlas.atlas import build_atlas, query
from compatlas.atlas.files import SESSIONS, wal_path
from compatlas.storage import QUARANTINE, atomic_path, checksum_path, remove_leftover_temps, write_shard
from compatlas.tables import COMPOSITION_SCHEMA, HEAD_SCORES_SCHEMA

NUMBERS = "SELECT (SELECT count(*) FROM composition) AS n, (SELECT round(sum(score), 9) FROM composition) AS s, " \
          "(SELECT count(*) FROM models) AS models, (SELECT count(*) FROM discoveries) AS d"


def composition_frame(model: str, rows: int = 400, seed: int = 0) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    n = rows
    df = pl.DataFrame({
        "model": model, "checkpoint": "final", "processing": "none", "space": "residual", "metric": "frobenius",
        "comp": rng.choice(["Q", "K", "V"], n), "writer_layer": np.zeros(n, np.int32), "writer_head": rng.integers(0, 8, n),
        "reader_layer": np.ones(n, np.int32), "reader_head": rng.integers(0, 8, n), "score": rng.uniform(0, 0.3, n),
        "baseline_gaussian_mean": 0.1, "baseline_gaussian_std": 0.02, "baseline_spectrum_mean": 0.1,
        "baseline_spectrum_std": 0.02})
    df = df.with_columns(pl.lit(None).alias(c) for c in COMPOSITION_SCHEMA if c not in df.columns)  # e.g. score_share
    return df.select(list(COMPOSITION_SCHEMA)).cast(COMPOSITION_SCHEMA)  # type: ignore[arg-type]


def make_atlas(project: Path) -> tuple[Path, dict[str, list[Path]], list[Path]]:
    """``project/results/``: two models' composition shards, a head_scores shard each, their
    meta.json, and the atlas over them."""
    results = project / "results"
    shards: dict[str, list[Path]] = {"composition": [], "head_scores": []}
    metas = []
    for i, m in enumerate(("a", "b")):
        p = results / "composition" / f"model={m}" / "checkpoint=final" / "block=0.parquet"
        write_shard(composition_frame(m, seed=i), p, {"model": m})
        shards["composition"].append(p)
        h = results / "induction" / f"model={m}" / "checkpoint=final" / "heads.parquet"
        write_shard(pl.DataFrame([{c: None for c in HEAD_SCORES_SCHEMA} | {"model": m, "checkpoint": "final",
                                                                             "layer": 0, "head": 0}],
                                 schema=HEAD_SCORES_SCHEMA), h, {"model": m})
        shards["head_scores"].append(h)
        meta = results / "weights" / m / "final" / "meta.json"
        meta.parent.mkdir(parents=True, exist_ok=True)
        meta.write_text(f'{{"model": "{m}", "checkpoint": "final", "n_layers": 2, "n_heads": 8, "n_kv_heads": 8}}')
        metas.append(meta)
    db = results / "atlas.duckdb"
    build_atlas(db, shards, metas)
    return db, shards, metas


def numbers(db: Path) -> tuple:
    return query(db, NUMBERS).row(0)


def tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


# ----------------------------------------------------------------------------- compatlas query

WRITES = {  # statement -> the type named in the refusal
    "COPY (SELECT 'oops' AS a) TO '{shard}' (FORMAT parquet)": "COPY",
    "COPY composition TO '{project}/out.csv'": "COPY",
    "EXPORT DATABASE '{project}/exported'": "EXPORT",
    "ATTACH '{other}' AS v (READ_WRITE)": "ATTACH",
    "ATTACH '{db}' AS again": "ATTACH",
    "DETACH memory": "DETACH",
    "INSTALL httpfs": "INSTALL",
    "FORCE INSTALL httpfs": "FORCE INSTALL",
    "LOAD httpfs": "LOAD",
    "DROP VIEW composition": "DROP",
    "DROP TABLE models": "DROP",
    "CREATE TABLE mine AS SELECT 1 AS a": "CREATE",
    "CREATE TEMP VIEW composition AS SELECT 1 AS a": "CREATE",
    "INSERT INTO models (model) VALUES ('x')": "INSERT",
    "UPDATE models SET model = 'x'": "UPDATE",
    "DELETE FROM models": "DELETE",
    "ALTER VIEW composition RENAME TO c2": "ALTER",
    "SET enable_external_access = true": "SET",
    "RESET allowed_directories": "SET",
    "CHECKPOINT": "CALL",
    "CALL duckdb_settings()": "CALL",
    "PRAGMA enable_profiling": "PRAGMA",
    "BEGIN TRANSACTION": "TRANSACTION",
    "VACUUM": "VACUUM",
    "SELECT 1; DROP VIEW composition": "DROP",
    "EXPLAIN ANALYZE COPY (SELECT 1) TO '{project}/x.parquet'": "EXPLAIN of a COPY",
    "EXPLAIN (ANALYZE) COPY (SELECT 1) TO '{shard}' (FORMAT parquet)": "EXPLAIN of a COPY",
    "EXPLAIN (FORMAT json) COPY composition TO '{project}/x.csv'": "EXPLAIN of a COPY",
    # a PIVOT whose values come from the data is a MULTI statement to DuckDB: named by what holds it
    "COPY (PIVOT composition ON comp USING count(*)) TO '{project}/p.csv'": "COPY",
    "CREATE TABLE mine AS PIVOT composition ON comp USING count(*)": "CREATE",
    "ALTER TABLE models ADD COLUMN z INTEGER DEFAULT 1": "ALTER",  # a MULTI statement too
}
READS = ("SELECT count(*) FROM composition", "WITH x AS (FROM models) SELECT * FROM x", "DESCRIBE composition",
         "SHOW TABLES", "SHOW ALL TABLES", "SUMMARIZE models", "EXPLAIN SELECT * FROM composition",
         "EXPLAIN ANALYZE SELECT 1", "EXPLAIN (ANALYZE) SELECT 1", "EXPLAIN (FORMAT json) SELECT 1",
         "PIVOT composition ON comp USING count(*) GROUP BY model", "UNPIVOT models ON n_heads, n_layers INTO NAME k VALUE v",
         "EXPLAIN ANALYZE PIVOT composition ON comp USING count(*)")


def test_query_refuses_every_write_and_reads_only_the_atlas_folder(capsys, tmp_path):
    db, shards, _ = make_atlas(tmp_path / "p")
    other, _, _ = make_atlas(tmp_path / "other")
    clean, before, before_other = numbers(db), tree(tmp_path / "p"), tree(tmp_path / "other")
    fill = {"shard": shards["composition"][0], "project": tmp_path / "p", "other": other, "db": db}
    for sql, kind in WRITES.items():
        rc, out, err = run_cli(capsys, "query", "--db", str(db), sql.format(**fill))
        assert rc == 1 and out == "" and len(err.strip().splitlines()) == 1, (sql, err)
        article = "an" if kind[0] in "AEIOU" else "a"
        assert err.startswith(f"compatlas: refused {article} {kind} statement: compatlas query runs read statements only"), (sql, err)
    assert tree(tmp_path / "p") == before and tree(tmp_path / "other") == before_other  # not a byte written
    for sql in ("SELECT * FROM read_csv('/etc/passwd')", f"SELECT * FROM read_parquet('{tmp_path}/other/results/**/*.parquet')",
                "SELECT * FROM 'https://example.com/x.csv'"):
        rc, _, err = run_cli(capsys, "query", "--db", str(db), sql)
        assert rc == 1 and len(err.strip().splitlines()) == 1 and "disabled by configuration" in err, (sql, err)
    for sql in READS:
        rc, out, err = run_cli(capsys, "query", "--db", str(db), sql)
        assert rc == 0 and out, (sql, err)
    assert numbers(db) == clean and tree(tmp_path / "p") == before


# ----------------------------------------------------------------------------- read-write sessions

def session(db: Path, sql: str, end: str) -> subprocess.Popen:
    """A plain ``duckdb.connect(db)`` (read-write, DuckDB's default) running ``sql``; ``end``:
    'kill' (SIGKILL after the writes: a crash), 'close' or 'wait' (holds the connection until a
    line on stdin, then runs stdin's SQL and closes)."""
    code = textwrap.dedent(f"""
        import os, signal, sys, duckdb
        con = duckdb.connect({str(db)!r})
        con.execute({sql!r}) if {sql!r} else None
        print("ready", flush=True)
        if {end!r} == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if {end!r} == "wait":
            more = sys.stdin.readline().strip()
            if more:
                con.execute(more)
        con.close()
    """)
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


CRASH = "DELETE FROM models WHERE model = 'a'; DROP VIEW discoveries; CREATE TABLE mine AS SELECT 42 AS answer"


def test_a_crashed_read_write_sessions_wal_is_kept_aside_and_never_replayed(capsys, tmp_path):
    db, shards, metas = make_atlas(tmp_path / "p")
    clean = numbers(db)
    s = session(db, CRASH, "kill")
    assert s.stdout.readline().strip() == "ready" and s.wait(60) == -signal.SIGKILL
    assert wal_path(db).exists()  # the crash left its writes in the WAL
    rc, out, err = run_cli(capsys, "query", "--db", str(db), "--format", "csv", NUMBERS)
    assert rc == 0 and out.splitlines()[1] == ",".join(map(str, clean)), out  # the WAL is not read
    assert "was left by a read-write session; its writes are not read" in err
    build_atlas(db, shards, metas)  # the rebuild (Snakemake removes atlas.duckdb first; the WAL stays)
    assert not wal_path(db).exists()
    assert numbers(db) == clean
    kept = list((db.parent / SESSIONS).glob("*/atlas.duckdb.wal"))
    assert len(kept) == 1  # the user's writes, kept where the log says, with the database they belong to
    import duckdb

    got = duckdb.connect(str(kept[0].with_name("atlas.duckdb")), read_only=True)
    assert got.execute("SELECT answer FROM mine").fetchone() == (42,)
    got.close()
    plain = duckdb.connect(str(db))  # a later plain read-write open replays nothing
    assert plain.execute("SELECT count(*) FROM models").fetchone() == (2,)
    assert plain.execute("SELECT count(*) FROM duckdb_views() WHERE view_name = 'discoveries'").fetchone() == (1,)
    plain.close()


def test_a_read_write_holder_across_a_rebuild_changes_nothing_read(capsys, tmp_path):
    db, shards, metas = make_atlas(tmp_path / "p")
    clean = numbers(db)
    holder = session(db, "DELETE FROM models WHERE model = 'a'", "wait")  # uncommitted to the file, lock held
    assert holder.stdout.readline().strip() == "ready"
    assert numbers(db) == clean  # its lock: compatlas reads a private copy of the file as built
    build_atlas(db, shards, metas)  # Snakemake has removed the old file; the holder keeps its inode
    assert numbers(db) == clean
    holder.stdin.write("CREATE TABLE mine AS SELECT 1 AS a; DROP VIEW composition\n")
    holder.stdin.flush()
    assert holder.wait(60) == 0  # its clean close checkpoints into the replaced file
    assert numbers(db) == clean
    rc, _, _ = run_cli(capsys, "query", "--db", str(db), "SELECT count(*) FROM models")
    assert rc == 0
    build_atlas(db, shards, metas)
    assert numbers(db) == clean and not wal_path(db).exists()


def test_an_atlas_changed_in_place_is_read_from_its_last_good_copy(capsys, tmp_path):
    import duckdb

    db, _, _ = make_atlas(tmp_path / "p")
    clean = numbers(db)
    con = duckdb.connect(str(db))  # a clean read-write session: its change checkpointed into the file
    con.execute("DELETE FROM models WHERE model = 'a'")
    con.close()
    rc, out, err = run_cli(capsys, "query", "--db", str(db), "--format", "csv", NUMBERS)
    assert rc == 0 and out.splitlines()[1] == ",".join(map(str, clean))
    assert err.count("compatlas: warning:") == 1, err  # said once, not once per statement compatlas runs
    assert ("was changed since it was built (its bytes no longer match the sha256 its build wrote; a read-write "
            "session, a copy or an edit over it, or a disk error); answering from the last good atlas") in err


# ----------------------------------------------------------------------------- shard content

def score_chunk(path: Path) -> tuple[int, int]:
    """The byte range of the score column's chunk in the shard (its pages, compressed)."""
    md = pq.read_metadata(path)
    col = next(md.row_group(0).column(i) for i in range(md.num_columns) if md.row_group(0).column(i).path_in_schema == "score")
    start = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
    return start, start + col.total_compressed_size


def test_sixty_byte_flips_in_the_score_column_are_each_caught_and_remade(tmp_path):
    db, shards, metas = make_atlas(tmp_path / "p")
    clean = numbers(db)
    victim = shards["composition"][1]
    good = victim.read_bytes()
    others = query(db, "SELECT count(*) AS n, round(sum(score), 9) AS s FROM composition WHERE model = 'a'").row(0)
    lo, hi = score_chunk(victim)
    rng = np.random.default_rng(30)
    silent = refused = 0  # flips that change the numbers read with no error / that the decoder refuses
    for pos in rng.integers(lo, hi, 60):
        bad = bytearray(good)
        bad[pos] ^= int(rng.integers(1, 256))
        victim.write_bytes(bytes(bad))
        try:
            silent += not pl.read_parquet(victim)["score"].equals(pl.read_parquet(good)["score"])
        except Exception:  # noqa: BLE001 -- a flip the decoder itself catches
            refused += 1
        build_atlas(db, shards, metas)
        assert query(db, "SELECT count(*) AS n, round(sum(score), 9) AS s FROM composition").row(0) == others
        ex = query(db, "SELECT path, error FROM excluded_shards")
        assert ex["path"].to_list() == [str(victim)] and "does not match its checksum" in ex["error"][0]
        assert not victim.exists()  # set aside: Snakemake remakes it
        write_shard(pl.read_parquet(good), victim, {"model": "b"})  # as the composition job would
    set_aside = [p for p in (db.parent / QUARANTINE).rglob("block=0.parquet.*") if not p.name.endswith(".sha256")]
    assert len(set_aside) == 60 and silent > 0
    build_atlas(db, shards, metas)
    assert numbers(db) == clean
    print(f"60 flips in the score column: all caught; without the checksum {silent} would have changed scores "
          f"silently, {refused} the decoder refuses, {60 - silent - refused} change no score")


def test_a_truncated_or_vanished_shard_degrades_its_model_and_names_the_file(capsys, tmp_path):
    db, shards, metas = make_atlas(tmp_path / "p")
    a_only = query(db, "SELECT count(*) AS n FROM composition WHERE model = 'a'")["n"][0]
    comp_b, heads_b = shards["composition"][1], shards["head_scores"][1]
    os.truncate(comp_b, 500)  # after the build: every connection checks what changed since
    heads_b.unlink()
    rc, out, err = run_cli(capsys, "query", "--db", str(db), "--format", "csv", "SELECT count(*) AS n FROM composition")
    assert rc == 0 and out.splitlines() == ["n", str(a_only)]
    assert f"result shard {comp_b} changed since the atlas was built (content does not match its checksum" in err
    assert f"result shard {heads_b} changed since the atlas was built (missing)" in err
    assert "2 result shards are left out of this atlas" in err
    assert query(db, "SELECT count(*) AS n FROM models")["n"][0] == 2  # every other query still answers
    build_atlas(db, {"composition": shards["composition"], "head_scores": shards["head_scores"][:1]}, metas)
    assert not comp_b.exists() and (db.parent / QUARANTINE).is_dir()  # set aside, to be remade
    assert query(db, "SELECT count(*) AS n FROM excluded_shards")["n"][0] == 1


def test_the_report_says_what_was_left_out_where_it_is_missing(tmp_path):
    from compatlas.report import build_report

    db, shards, metas = make_atlas(tmp_path / "p")
    os.truncate(shards["head_scores"][1], 100)
    build_atlas(db, shards, metas)
    out = tmp_path / "report"
    build_report(db, out, png=False)
    index, a, b = ((out / n).read_text(encoding="utf-8") for n in ("index.html", "model-a.html", "model-b.html"))
    for page in (index, b):
        assert "Incomplete: 1 result shard left out of this atlas" in page
        assert "head scores and ablation" in page and "model=b/checkpoint=final/heads.parquet" in page
    assert "Incomplete" not in a


# ----------------------------------------------------------------------------- smaller faults

def test_duplicate_config_keys_are_named_with_their_line(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("metrics: [frobenius]\nspaces: [residual]\nmetrics: [svd_bound]\nmodels: {}\n")
    rc, _, err = run_cli(capsys, "validate", str(cfg))
    assert rc == 1 and err.strip() == (f"{cfg}: duplicate key 'metrics' at line 3 (first at line 1): YAML would keep "
                                       "only the last; remove one")


def test_merge_keys_are_defaults_not_duplicates(tmp_path):
    """``<<: *recipe`` (config/training-seeds.yaml) merges the anchor's keys; the mapping's own keys win."""
    from compatlas.plan.config import load_config_file

    cfg = tmp_path / "c.yaml"
    cfg.write_text("training:\n  a: &r {steps: 10, seed: 0}\n  b: {<<: *r, seed: 1}\n")
    assert load_config_file(cfg)["training"] == {"a": {"steps": 10, "seed": 0}, "b": {"steps": 10, "seed": 1}}
    for name in ("training-seeds.yaml", "training-sweep.yaml"):
        assert load_config_file(Path(__file__).parents[1] / "config" / name)["training"]


def test_blocks_beyond_the_tiles_of_the_layer_grid_are_noted():
    from compatlas.plan import build_plan

    cfg = {"results": "results", "composition": {"blocks": 100}, "models": {"four": {"source": {
        "kind": "build", "architecture": "gpt2", "n_layers": 4, "n_heads": 2, "d_head": 8, "d_vocab": 64}}}}
    assert build_plan(cfg).notes == ("models.four: blocks 100 is more than the 10 tiles of its 4 layers' grid: 90 of its "
                                     "composition jobs per metric x space x checkpoint score nothing (blocks: 10 is enough)",)
    cfg["composition"]["blocks"] = 10  # one tile a job: each scores some pairs (a diagonal tile its same-layer ones)
    assert build_plan(cfg).notes == ()


def test_leftover_temp_files_are_removed(tmp_path):
    kept = tmp_path / "composition" / "block=0.parquet"
    write_shard(composition_frame("a"), kept, {})
    left = [kept.with_name(".block=0.parquet.abc123.tmp"), tmp_path / ".atlas.duckdb.x1y2.tmp",
            tmp_path / ".atlas.duckdb.x1y2.tmp.wal"]
    for p in left:
        p.write_bytes(b"half")
    assert sorted(remove_leftover_temps(tmp_path)) == sorted(left)
    assert not any(p.exists() for p in left) and kept.exists() and checksum_path(kept).exists()


def test_a_full_disk_names_the_file_and_the_space(tmp_path):
    target = tmp_path / "weights" / "weights.safetensors"
    with pytest.raises(OSError) as e:
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"x" * 4096)
            raise OSError(errno.ENOSPC, "No space left on device")
    assert e.value.errno == errno.ENOSPC and str(target) in str(e.value) and "0.0 MB written" in str(e.value)
    assert "MB free in" in str(e.value) and not list(target.parent.glob(".*.tmp"))
    with pytest.raises(OSError, match=r"writing .*weights.safetensors: it needs 4\.4 MB \("):
        with atomic_path(target, need=4_400_000):
            raise OSError(errno.ENOSPC, "No space left on device")
