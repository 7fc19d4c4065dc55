"""The atlas as a store: relocatable (shard paths relative to its folder) and tolerant of a bad
shard (left out with a warning and a row in `excluded_shards`, the others still queryable)."""

from __future__ import annotations

import shutil
from pathlib import Path

import polars as pl

from compatlas.atlas import build_atlas, query
from compatlas.storage import write_shard
from compatlas.tables import COMPOSITION_SCHEMA


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


def test_atlas_opened_from_a_folder_with_another_atlas_reads_its_own_shards(tmp_path: Path, monkeypatch):
    """DuckDB looks a relative path up in the working directory first: opened from a project folder
    whose own results/ holds a shard of the same path, the views (and the derived ones over them)
    must still read the opened atlas's shards, not the working directory's."""
    other = tmp_path / "project" / "results"
    build_atlas(other / "atlas.duckdb", make_results(other), [])
    shard(other / "composition" / "model=a" / "block=0.parquet", "a", 0.75)  # the working directory's atlas differs
    mine = tmp_path / "run2" / "results"
    build_atlas(mine / "atlas.duckdb", make_results(mine), [])
    monkeypatch.chdir(tmp_path / "project")
    got = query(mine / "atlas.duckdb", "SELECT model, score FROM composition ORDER BY model")
    assert got.rows() == [("a", 0.25), ("b", 0.5)]
    assert query(mine / "atlas.duckdb", "SELECT count(*) AS n FROM composition_z")["n"].item() == 2
    assert query(other / "atlas.duckdb", "SELECT score FROM composition WHERE model = 'a'")["score"].to_list() == [0.75]


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


def test_plain_duckdb_answers_from_the_project_folder(tmp_path: Path):
    """``duckdb.connect("results/atlas.duckdb")`` as a DuckDB user types it, in a fresh process
    started in the project folder, with nothing set; from another folder the view's comment names
    the one line to run first, and that line is enough."""
    import subprocess
    import sys

    project = tmp_path / "project"
    build_atlas(project / "results" / "atlas.duckdb", make_results(project / "results"), [])
    plain = ("import duckdb, sys; con = duckdb.connect('{db}', read_only=True); [con.execute(s) for s in sys.argv[1:]]; "
             "print(con.execute('SELECT count(*) FROM composition').fetchone()[0])")
    here = subprocess.run([sys.executable, "-c", plain.format(db="results/atlas.duckdb")], cwd=project,
                          capture_output=True, text=True, timeout=120)
    assert here.returncode == 0 and here.stdout.strip() == "2", here.stderr
    db = project / "results" / "atlas.duckdb"
    elsewhere = subprocess.run([sys.executable, "-c", plain.format(db=db)], cwd=tmp_path,
                               capture_output=True, text=True, timeout=120)
    assert elsewhere.returncode != 0 and "No files found" in elsewhere.stderr
    comment = query(db, "SELECT comment FROM duckdb_views() WHERE view_name = 'composition'")["comment"][0]
    line = f"SET file_search_path = '{project.resolve()}'"
    assert comment.endswith(f"from elsewhere first run: {line}"), comment
    fixed = subprocess.run([sys.executable, "-c", plain.format(db=db), line], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert fixed.returncode == 0 and fixed.stdout.strip() == "2", fixed.stderr


def test_duckdb_1x_cli_opens_the_atlas(tmp_path: Path):
    """The atlas is written in a storage format DuckDB 1.x reads (64..68; a file of the newest
    format says 'Trying to read a database file with version number ...'), and the DuckDB 1.x
    command line, run from the project folder, answers from it (envs/ installs ``duckdb-cli``)."""
    import shutil
    import subprocess
    import sys

    project = tmp_path / "project"
    db = project / "results" / "atlas.duckdb"
    from compatlas.function.comp_agreement import agreement_tables

    build_atlas(db, make_results(project / "results"), [], computed=agreement_tables)  # as the atlas rule does
    header = db.read_bytes()[:16]
    assert header[8:12] == b"DUCK" and 64 <= int.from_bytes(header[12:16], "little") <= 68, header
    cli = shutil.which("duckdb", path=str(Path(sys.executable).parent)) or shutil.which("duckdb")
    assert cli, "no duckdb command line: pip install duckdb-cli==1.5.6 (envs/requirements-cpu.txt has it)"
    version = subprocess.run([cli, "--version"], capture_output=True, text=True, timeout=60).stdout
    assert version.startswith("v1."), f"{cli} is DuckDB {version.strip()}, not 1.x"
    out = subprocess.run([cli, "-readonly", "-csv", "results/atlas.duckdb", "-c",
                          "SELECT count(*) AS n FROM composition; SELECT count(*) AS n FROM composition_z"],
                         cwd=project, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["n", "2", "n", "2"], (out.stdout, out.stderr)
    # every table and view binds in DuckDB 1.x's SQL too (the derived views are SQL written for 2.x)
    from compatlas.cli import TABLES

    every = "; ".join(f"SELECT '{v}' AS v, count(*) AS n FROM {v}" for v in TABLES)
    out = subprocess.run([cli, "-readonly", "-csv", "-noheader", "results/atlas.duckdb", "-c", every],
                         cwd=project, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and [ln.split(",")[0] for ln in out.stdout.split()] == list(TABLES), out.stderr


def test_every_view_with_a_checkpoint_carries_latest(tmp_path: Path):
    """`WHERE latest` means the last checkpoint of each model in every view and table that has a
    checkpoint (not only in composition_z and discoveries): the flag is checkpoints' own, and in
    a series only the highest step's rows carry it."""
    from synthetic_atlas import Spec, write_suite

    from compatlas.atlas import connect

    db = write_suite(tmp_path, [Spec("run", 2, 2, steps=[0, 4, 64], edges=True), Spec("solo", 2, 2, edges=True)])
    con = connect(db)
    relations = [r[0] for r in con.execute("SELECT DISTINCT table_name FROM information_schema.columns "
                                           "WHERE column_name = 'checkpoint' ORDER BY 1").fetchall()]
    assert {"composition", "head_scores", "induction_summary", "composition_vs_function", "eap_vs_exact",
            "reader_best_composition", "composition_vs_behaviour", "discoveries"} <= set(relations), relations
    missing = [r for r in relations if r != "models" and "latest" not in
               [c[0] for c in con.execute(f"DESCRIBE {r}").fetchall()]]
    assert not missing, f"views with a checkpoint but no `latest`: {missing}"
    for r in relations:
        if r == "models":
            continue
        wrong = con.execute(f"SELECT count(*) FROM {r} v JOIN checkpoints k USING (model, checkpoint) "
                            "WHERE v.latest IS DISTINCT FROM k.latest").fetchall()[0][0]
        latest = {tuple(x) for x in con.execute(f"SELECT DISTINCT model, checkpoint FROM {r} WHERE latest").fetchall()}
        assert wrong == 0, r
        present = {tuple(x) for x in con.execute(f"SELECT DISTINCT model, checkpoint FROM {r}").fetchall()}
        assert r not in ("composition", "head_scores") or {("run", "step0"), ("run", "step64")} <= present, present
        assert latest == {x for x in {("run", "step64"), ("solo", "final")} if x in present}, (r, latest, present)


def test_every_documented_query_runs_on_an_atlas_of_the_default_runs_shapes(tmp_path: Path):
    """Each query README.md and docs/*.md show (benchmarks/bench_queries.documented_queries: every
    ```sql block and every `compatlas query "..."`) runs on a fresh read-only connection to an atlas
    of every space, with a checkpoint series and edge attribution: no column a doc names is
    missing, no `latest` ambiguous. (Their figures on the default run: test_default_run_figures.)"""
    import sys

    from synthetic_atlas import DEFAULT_SPACES, Spec, write_suite

    from compatlas.atlas import connect

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_queries import documented_queries

    db = write_suite(tmp_path, [Spec("run", 2, 2, steps=[0, 4], edges=True), Spec("smollm2-135m", 3, 3, edges=True)],
                     spaces=DEFAULT_SPACES)
    queries = documented_queries()
    assert len(queries) >= 6 and {w for w, _ in queries} >= {"README.md", "schema.md", "edge_attribution.md"}
    failed = []
    for where, sql in queries:
        con = connect(db)
        try:
            con.execute(sql).fetchall()
        except Exception as e:  # noqa: BLE001 - each failure is listed
            failed.append(f"{where}: {sql[:80]!r}: {e}")
        finally:
            con.close()
    assert not failed, "\n".join(failed)


def test_an_atlas_built_before_a_column_was_added_still_opens(tmp_path: Path, monkeypatch):
    """A column the code's schema gained after the atlas was built (edge_attribution's exact_sample
    once) reads as NULL in that atlas's views, as in a fresh build over old shards: upgrading the
    code does not break the last good atlas."""
    import polars as pl
    from synthetic_atlas import Spec, write_suite

    from compatlas import tables
    from compatlas.atlas import connect

    db = write_suite(tmp_path, [Spec("solo", 2, 2, edges=True)])
    monkeypatch.setitem(tables.SHARD_VIEWS, "edge_attribution", {**tables.EDGE_ATTRIBUTION_SCHEMA, "added_later": pl.Utf8})
    con = connect(db)
    rows = con.execute("SELECT count(*), count(added_later), count(exact_sample) FROM edge_attribution").fetchall()[0]
    assert rows[0] > 0 and rows[1] == 0 and rows[2] == rows[0]
