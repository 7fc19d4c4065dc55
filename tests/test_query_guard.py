"""`compatlas query` under load and abuse: every read DuckDB has runs (PIVOT, EXPLAIN (ANALYZE),
SHOW ALL TABLES) and a refused statement is named by what it is; SQL that is not UTF-8 is one
line; nothing is written under results/ by a query larger than memory (its spill goes to a
private folder, removed on exit, a killed query's by the next one); a time limit and Ctrl-C
stop a query at once; --max-rows computes no more rows than it shows; CSV writes nested columns
as JSON; the last good atlas answers while the atlas is missing, each warning said once."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
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
from compatlas.atlas.running import INTERRUPTED, TIMED_OUT

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

def test_a_time_limit_stops_a_query_in_one_line(capsys, atlas):
    start = time.monotonic()
    rc, out, err = run(capsys, "query", "--db", str(atlas), "--timeout", "0.5", LONG)
    took = time.monotonic() - start
    assert rc == 124 and out == "" and err == "compatlas: query stopped by its time limit of 0.5 s (--timeout)\n", err
    assert took < 0.5 + 5 * machine_slowdown(), took
    with pytest.raises(SystemExit):
        cli.main(["query", "--help"])
    helped = " ".join(capsys.readouterr().out.split())
    assert f"(exit status {TIMED_OUT}); Ctrl-C stops it at once (exit status {INTERRUPTED})" in helped
    rc, out, _ = run(capsys, "query", "--db", str(atlas), "--timeout", "60", "SELECT 42 AS a")
    assert rc == 0 and out.splitlines()[-1] == "42"  # and a query within it answers
    rc, out, err = run(capsys, "query", "--db", str(atlas), "--timeout", "0.5", "--format", "csv",
                       "SELECT range, hash(range) FROM range(100000000000)")
    assert rc == 124 and out.startswith("range,") and err.startswith(
        "compatlas: query stopped by its time limit of 0.5 s (--timeout); the "), err
    assert err.strip().endswith("rows written before it are not the whole answer") and len(err.splitlines()) == 1


def test_ctrl_c_stops_a_running_query_at_once(atlas, tmp_path):
    """SIGINT to a real process: DuckDB's client holds the main thread while it runs, so before the
    query ran in a worker thread a Ctrl-C waited for the query to end (over 20 s measured)."""
    spills = tmp_path / "tmp"
    spills.mkdir()
    code = "import sys\nprint('ready', flush=True)\nfrom compatlas import cli\nsys.exit(cli.main(sys.argv[1:]))"
    job = subprocess.Popen([sys.executable, "-c", code, "query", "--db", str(atlas), LONG], text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, TMPDIR=str(spills)))
    try:
        assert job.stdout is not None and job.stdout.readline() == "ready\n"
        deadline = time.monotonic() + 60 * machine_slowdown()
        while not list(spills.iterdir()) and time.monotonic() < deadline:  # connected: its spill folder is there
            time.sleep(0.05)
        time.sleep(1)  # the query running
        start = time.monotonic()
        job.send_signal(signal.SIGINT)
        out, err = job.communicate(timeout=10 * machine_slowdown())
        took = time.monotonic() - start
    finally:
        job.kill()
        job.wait()
    assert job.returncode == 130 and out == "" and err == "compatlas: query stopped by Ctrl-C\n", (job.returncode, err)
    assert took < 3 * machine_slowdown(), took
    assert list(spills.iterdir()) == []  # its spill folder removed on the way out


# ----------------------------------------------------------------------------- rows

def test_max_rows_computes_only_the_rows_it_shows(capsys, atlas):
    huge = "SELECT range AS i FROM range(1000000000000)"  # 10^12 rows: hours, were they all computed
    for fmt in ("table", "csv", "json"):
        start = time.monotonic()
        rc, out, err = run(capsys, "query", "--db", str(atlas), "--format", fmt, "--max-rows", "3", "--timeout", "120", huge)
        assert rc == 0 and time.monotonic() - start < 10 * machine_slowdown(), (fmt, err)
        assert err.strip() == "compatlas: 3 rows shown; the answer has more (--max-rows 3; 0: every row)"
        if fmt == "table":
            assert out.splitlines()[2:] == ["0", "1", "2", "(more than 3 rows; the first 3 shown: --max-rows)"]
        elif fmt == "csv":
            assert out.splitlines() == ["i", "0", "1", "2"]
        else:
            assert json.loads(out) == [{"i": 0}, {"i": 1}, {"i": 2}]


def test_csv_and_json_stream_every_row_by_default(capsys, atlas):
    rc, out, err = run(capsys, "query", "--db", str(atlas), "--format", "csv", "SELECT range AS i FROM range(150000)")
    lines = out.splitlines()  # three batches of DuckDB's stream, one header
    assert rc == 0 and lines[0] == "i" and lines[1:] == [str(i) for i in range(150000)] and err == "compatlas: 150000 rows\n"
    rc, out, _ = run(capsys, "query", "--db", str(atlas), "--format", "json", "SELECT range AS i FROM range(150000)")
    assert rc == 0 and [r["i"] for r in json.loads(out)] == list(range(150000))
    rc, out, _ = run(capsys, "query", "--db", str(atlas), "--format", "json", "SELECT 1 AS a, 2 AS a WHERE false")
    assert rc == 0 and out == "[]\n"
    rc, out, _ = run(capsys, "query", "--db", str(atlas), "--format", "csv", "SELECT 1 AS a, 2 AS a")
    assert rc == 0 and out.splitlines() == ["a,a_1", "1,2"]


def test_csv_writes_nested_columns_as_json(capsys, atlas):
    rc, out, err = run(capsys, "query", "--db", str(atlas), "--format", "csv",
                       "SELECT model, test_reader_heads FROM composition_z ORDER BY ALL LIMIT 1")
    assert rc == 0, err
    row = next(csv.DictReader(io.StringIO(out)))
    assert row["model"] == "a" and isinstance(json.loads(row["test_reader_heads"]), list)
    rc, out, err = run(capsys, "query", "--db", str(atlas), "--format", "csv", "SHOW ALL TABLES")
    tables = list(csv.DictReader(io.StringIO(out)))
    assert rc == 0 and "score" in json.loads(next(t for t in tables if t["name"] == "composition")["column_names"]), err
    sql = ("SELECT {'x': 1, 'y': [1, 2]} AS s, MAP {'k': 1} AS m, [[1], [2]] AS ll, [1, 2]::INTEGER[2] AS a, "
           "'\\xC3\\x01a'::BLOB AS b, NULL::INTEGER[] AS n, [DATE '2020-01-02'] AS d")
    rc, out, err = run(capsys, "query", "--db", str(atlas), "--format", "csv", sql)
    assert rc == 0, err
    assert next(csv.reader(io.StringIO(out.splitlines()[1]))) == [
        '{"x": 1, "y": [1, 2]}', '{"k": 1}', "[[1], [2]]", "[1, 2]", "\\xC3\\x01a", "", '["2020-01-02"]']
    rc, out, err = run(capsys, "query", "--db", str(atlas), "--format", "json", sql)
    assert rc == 0 and json.loads(out)[0]["b"] == "\\xC3\\x01a" and json.loads(out)[0]["s"] == {"x": 1, "y": [1, 2]}, err


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


def test_a_byte_flipped_in_the_atlas_is_said_once_with_its_likely_causes(capsys, tmp_path):
    db, _, _ = make_atlas(tmp_path / "p")
    clean = query(db, NUMBERS).row(0)
    data = bytearray(db.read_bytes())
    data[len(data) // 2] ^= 0x01  # rot on the disk, not a session
    db.write_bytes(bytes(data))
    rc, out, err = run(capsys, "query", "--db", str(db), "--format", "csv", NUMBERS)
    assert rc == 0 and out.splitlines()[1] == ",".join(map(str, clean))
    assert err.splitlines() == [
        f"compatlas: warning: {db} was changed since it was built (its bytes no longer match the sha256 its build "
        "wrote; a read-write session, a copy or an edit over it, or a disk error); answering from the last good atlas "
        f"{last_good_path(db)} (the next snakemake run rebuilds it)", "compatlas: 1 row"]
