"""`compatlas query` under load and abuse: every read DuckDB has runs (PIVOT, EXPLAIN (ANALYZE),
SHOW ALL TABLES) and a refused statement is named by what it is; SQL that is not UTF-8 is one
line; nothing is written under results/ by a query larger than memory (its spill goes to a
private folder, removed on exit, a killed query's by the next one); a time limit and Ctrl-C
stop a query at once; --max-rows computes no more rows than it shows; CSV writes nested columns
as JSON; the last good atlas answers while the atlas is missing, each warning said once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import duckdb
import pytest
from conftest import machine_slowdown
from test_faults import NUMBERS, make_atlas

from compatlas import cli
from compatlas.atlas import connect, query
from compatlas.atlas.files import last_good_path
from compatlas.atlas.query_guard import RefusedStatement, check_read_only

LONG = "SELECT sum(hash(range)) AS s FROM range(100000000000)"  # hours of work: only a stop ends it


@pytest.fixture(scope="module")
def atlas(tmp_path_factory) -> Path:
    db, _, _ = make_atlas(tmp_path_factory.mktemp("query") / "p")
    return db


@pytest.fixture
def private_tmp(tmp_path, monkeypatch) -> Path:
    """The system's temporary folder, for this test: an empty one of its own."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def listing(folder: Path) -> dict[str, tuple[bool, int, int]]:
    """Every file and folder under ``folder`` (itself too) with its size and mtime: a file made and
    removed again still changes its folder's mtime."""
    return {str(p.relative_to(folder)): (p.is_dir(), p.stat().st_size, p.stat().st_mtime_ns)
            for p in [folder, *sorted(folder.rglob("*"))]}


# ----------------------------------------------------------------------------- what runs, what is refused

def test_every_read_runs_and_gives_its_rows(capsys, atlas):
    rc, out, _ = run(capsys, "query", "--db", str(atlas), "--format", "csv",
                     "PIVOT composition ON comp USING count(*) GROUP BY model ORDER BY model")
    assert rc == 0 and out.splitlines()[0] == "model,K,Q,V" and len(out.splitlines()) == 3, out
    rc, out, _ = run(capsys, "query", "--db", str(atlas), "--format", "json",
                     "UNPIVOT (SELECT 1 AS a, 2 AS b) ON a, b INTO NAME k VALUE v")
    assert rc == 0 and json.loads(out) == [{"k": "a", "v": 1}, {"k": "b", "v": 2}]
    for sql, first in (("EXPLAIN ANALYZE SELECT 1", "analyzed_plan"), ("EXPLAIN (ANALYZE) SELECT 1", "analyzed_plan"),
                       ("EXPLAIN (FORMAT json) SELECT 1", "physical_plan"), ("EXPLAIN PIVOT models ON model", "physical_plan")):
        rc, out, err = run(capsys, "query", "--db", str(atlas), "--format", "json", sql)
        assert rc == 0 and json.loads(out)[0]["explain_key"] == first, (sql, err)
    rc, out, _ = run(capsys, "query", "--db", str(atlas), "--format", "json", "EXPLAIN (FORMAT json) SELECT 1")
    assert json.loads(json.loads(out)[0]["explain_value"])[0]["name"] == "PROJECTION"  # the plan, as JSON
    for sql in ("SHOW ALL TABLES", "SHOW TABLES", "DESCRIBE composition", "SUMMARIZE models", "FROM models",
                "SELECT * FROM (PIVOT composition ON comp USING count(*)) JOIN models USING (model)"):
        rc, out, err = run(capsys, "query", "--db", str(atlas), sql)
        assert rc == 0 and out and " rows" in err.strip().splitlines()[-1], (sql, err)


REFUSED = {  # statement -> what the refusal calls it
    "CREATE TABLE t AS PIVOT composition ON comp": "a CREATE",
    "COPY (PIVOT composition ON comp) TO 'x.csv'": "a COPY",
    "INSERT INTO t PIVOT composition ON comp": "an INSERT",
    "WITH x AS (PIVOT composition ON comp) INSERT INTO t FROM x": "an INSERT",
    "EXPLAIN (ANALYZE) COPY (SELECT 1) TO 'x.csv'": "an EXPLAIN of a COPY",
    "EXPLAIN (FORMAT json) CREATE TABLE t AS SELECT 1": "an EXPLAIN of a CREATE",
    "EXPLAIN ANALYZE CREATE TABLE t AS PIVOT composition ON comp": "an EXPLAIN of a CREATE",
    "ALTER TABLE models ADD COLUMN z INTEGER DEFAULT 1": "an ALTER",
    "SELECT 1; PIVOT models ON model; DROP VIEW composition": "a DROP",
}


def test_statements_are_named_by_what_they_are_not_multi():
    for sql, kind in REFUSED.items():
        with pytest.raises(RefusedStatement) as e:
            check_read_only(sql)
        assert str(e.value).startswith(f"refused {kind} statement: compatlas query runs read statements only"), sql
    for sql in ("PIVOT composition ON comp",  # a MULTI statement to DuckDB: a temporary ENUM, then the SELECT
                "PIVOT_WIDER composition ON comp", "PIVOT (PIVOT composition ON comp) ON model",
                "EXPLAIN (SELECT 1) UNION SELECT 2", "EXPLAIN ANALYZE (SELECT 1)",
                "SELECT 'pivot', \"pivot\" FROM (PIVOT composition ON comp) -- pivot (\n",
                "SELECT * FROM (PIVOT composition ON comp) JOIN models PIVOT (count(*) FOR model IN ('a')) USING (checkpoint)"):
        check_read_only(sql)


def test_sql_that_is_not_utf8_is_one_line(capsys, atlas):
    latin1 = b"SELECT 'caf\xe9' AS x"
    with pytest.raises(RefusedStatement, match=r"^the SQL is not UTF-8 text \(byte 0xe9 at offset 11\)"):
        query(atlas, latin1)
    assert query(atlas, "SELECT 'café' AS x".encode())["x"][0] == "café"  # UTF-8 bytes are fine
    argv = latin1.decode("utf-8", "surrogateescape")  # what Python makes of a latin-1 argument
    rc, out, err = run(capsys, "query", "--db", str(atlas), argv)
    assert rc == 1 and out == "" and err.startswith("compatlas: the SQL is not UTF-8 text (byte 0xe9 at offset 11); "
                                                     "save or pass it as UTF-8"), err
    assert len(err.strip().splitlines()) == 1
    code = "import sys\nfrom compatlas import cli\nsys.exit(cli.main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", code, "query", "--db", str(atlas), latin1], capture_output=True, timeout=300)
    assert done.returncode == 1 and done.stderr.decode().startswith("compatlas: the SQL is not UTF-8 text"), done.stderr
    assert len(done.stderr.splitlines()) == 1


# ----------------------------------------------------------------------------- nothing written under results/

SPILL = "SELECT count(*) AS n FROM (SELECT hash(range) % 2000000 AS g, count(*) FROM range(8000000) GROUP BY g)"
SMALL = {"memory_limit": "50MB", "threads": "1"}  # so that SPILL spills (2 s)


def test_a_query_larger_than_memory_spills_outside_results(tmp_path, private_tmp):
    db, _, _ = make_atlas(tmp_path / "p")
    results = db.parent
    before = listing(results)
    con = duckdb.connect(str(db), read_only=True, config=SMALL)  # DuckDB's default: atlas.duckdb.tmp/ beside it
    n = con.sql(SPILL).fetchall()[0][0]
    con.close()
    assert listing(results) != before  # the control: this query spills, and by default under results/
    before = listing(results)
    seen: set[str] = set()
    stop = threading.Event()

    def watch() -> None:  # the spill files, while the query runs
        while not stop.is_set():
            seen.update(p.name for p in private_tmp.rglob("duckdb_temp*"))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        assert query(db, SPILL, SMALL)["n"][0] == n
    finally:
        stop.set()
        watcher.join()
    assert seen, "the query did not spill"
    assert listing(results) == before  # not a file made, changed or removed under results/
    assert list(private_tmp.iterdir()) == []  # and its private folder removed
    with pytest.raises(duckdb.Error):
        query(db, "SELECT * FROM nowhere")
    assert list(private_tmp.iterdir()) == []  # on an error too


def test_a_killed_querys_spill_folder_is_removed_by_the_next_query(tmp_path, private_tmp):
    db, _, _ = make_atlas(tmp_path / "p")
    code = f"import sys\nfrom compatlas.atlas import query\nquery(sys.argv[1], {LONG!r})"
    job = subprocess.Popen([sys.executable, "-c", code, str(db)], env=dict(os.environ, TMPDIR=str(private_tmp)))
    try:
        deadline = time.monotonic() + 60 * machine_slowdown()
        while not list(private_tmp.glob(f"compatlas-spill-{job.pid}-*")) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        job.kill()
        job.wait()
    left = list(private_tmp.glob(f"compatlas-spill-{job.pid}-*"))
    assert len(left) == 1  # SIGKILL: nothing could remove it
    live = private_tmp / f"compatlas-spill-{os.getpid()}-other"  # a running process's: never touched
    live.mkdir()
    unrelated = private_tmp / "compatlas-spill-notes"
    unrelated.mkdir()
    assert query(db, "SELECT 1 AS a")["a"][0] == 1
    assert not left[0].exists() and live.exists() and unrelated.exists()


# ----------------------------------------------------------------------------- stopping a query

# ----------------------------------------------------------------------------- rows

# ----------------------------------------------------------------------------- the atlas file

def test_connect_answers_from_the_last_good_copy_while_the_atlas_is_missing(capsys, tmp_path, caplog):
    db, _, _ = make_atlas(tmp_path / "p")
    clean = query(db, NUMBERS).row(0)
    db.unlink()  # as Snakemake leaves it while the atlas job runs, or after it failed
    with caplog.at_level("WARNING", logger="compatlas"):
        con = connect(db)
        assert con.sql(NUMBERS).fetchall()[0] == clean
        con.close()
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"no {db} (a rebuild running or failed); answering from the last good atlas {last_good_path(db)}"]
    rc, out, err = run(capsys, "query", "--db", str(db), "--format", "csv", NUMBERS)
    assert rc == 0 and out.splitlines()[1] == ",".join(map(str, clean))
    assert err.splitlines() == [f"compatlas: warning: {said[0]}", "compatlas: 1 row"]  # once
    last_good_path(db).unlink()
    with pytest.raises(FileNotFoundError, match=r"no atlas at .* run the pipeline first"):
        connect(db)


