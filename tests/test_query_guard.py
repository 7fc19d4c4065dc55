"""`compatlas query` under load and abuse: every read DuckDB has runs (PIVOT, EXPLAIN (ANALYZE),
SHOW ALL TABLES) and a refused statement is named by what it is; SQL that is not UTF-8 is one
line; nothing is written under results/ by a query larger than memory (its spill goes to a
private folder, removed on exit, a killed query's by the next one); a time limit and Ctrl-C
stop a query at once; --max-rows computes no more rows than it shows; CSV writes nested columns
as JSON; the last good atlas answers while the atlas is missing, each warning said once."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from test_faults import make_atlas

from compatlas import cli
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


# ----------------------------------------------------------------------------- nothing written under results/

SPILL = "SELECT count(*) AS n FROM (SELECT hash(range) % 2000000 AS g, count(*) FROM range(8000000) GROUP BY g)"
SMALL = {"memory_limit": "50MB", "threads": "1"}  # so that SPILL spills (2 s)


# ----------------------------------------------------------------------------- stopping a query

# ----------------------------------------------------------------------------- rows

# ----------------------------------------------------------------------------- the atlas file

