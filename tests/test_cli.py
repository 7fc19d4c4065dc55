"""The command line: one line per error, the views listed in `query --help`, readable tables."""

from __future__ import annotations

import json

import polars as pl

from compatlas import cli
from compatlas.storage import write_shard


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:  # argparse's --help
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_validate_missing_file_and_yaml_error_are_one_line(capsys, tmp_path):
    rc, _, err = run(capsys, "validate", str(tmp_path / "nope.yaml"))
    assert rc == 1 and err.strip() == f"{tmp_path / 'nope.yaml'}: cannot read it: No such file or directory"
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  a: {source: [unclosed\n")
    rc, _, err = run(capsys, "validate", str(bad))
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"{bad}: not valid YAML at line 3"), err
    bad.write_text("models:\n  a:\n    source: {kind: build, architecture: gpt3}\n")
    rc, _, err = run(capsys, "validate", str(bad))
    assert rc == 1 and len(err.strip().splitlines()) == 1 and err.startswith(f"{bad}: config error at models.a"), err


def test_check_shards_names_the_bad_shard_in_one_line_and_its_advice_works(capsys, tmp_path):
    good, bad = tmp_path / "a" / "good.parquet", tmp_path / "a" / "bad.parquet"
    write_shard(pl.DataFrame({"x": [1.0, 2.0]}), good, {})
    write_shard(pl.DataFrame({"x": [1.0, 2.0]}), bad, {})
    bad.write_bytes(bad.read_bytes()[:40])
    rc, _, err = run(capsys, "check-shards", str(tmp_path))
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert str(bad) in err and "corrupt or truncated" in err and "content does not match its checksum" in err
    assert f"compatlas check-shards --set-aside {tmp_path}" in err  # the advice, followed next
    rc, _, err = run(capsys, "check-shards", "--set-aside", str(tmp_path))
    assert rc == 1 and "set aside as" in err and not bad.exists()
    assert len(list((tmp_path / "quarantine" / "a").glob("bad.parquet.*"))) == 2  # the shard and its checksum
    rc, out, _ = run(capsys, "check-shards", str(tmp_path))
    assert rc == 0 and out.strip() == "1 shards match their checksums"


def test_query_help_lists_every_view_the_atlas_has(capsys, tmp_path):
    from compatlas.atlas import build_atlas, query
    from compatlas.function.comp_agreement import agreement_tables

    db = tmp_path / "atlas.duckdb"
    build_atlas(db, {}, [], computed=agreement_tables)  # as the atlas rule builds it: with its computed tables
    names = set(query(db, "SELECT table_name FROM information_schema.tables")["table_name"])
    assert names == set(cli.TABLES)
    rc, out, _ = run(capsys, "query", "--help")
    assert rc == 0 and all(f"  {n} " in out for n in names), out


def test_wide_rows_print_as_blocks_and_narrow_ones_as_a_table(capsys, tmp_path):
    wide = pl.DataFrame({f"column_{i}": [f"value {i}"] for i in range(30)})
    text = cli.render_table(wide, 100)
    assert all(len(line) <= 100 for line in text.splitlines())
    assert text.splitlines()[0].startswith("-[ row 1 ]") and "column_29 | value 29" in text
    narrow = pl.DataFrame({"model": ["a", "bb"], "n": [1, 22]})
    assert cli.render_table(narrow, 100).splitlines() == ["model | n", "------+---", "a     | 1", "bb    | 22"]


def test_query_formats(capsys, tmp_path):
    from compatlas.atlas import build_atlas

    db = tmp_path / "atlas.duckdb"
    build_atlas(db, {}, [])
    rc, out, _ = run(capsys, "query", "--db", str(db), "--format", "json", "SELECT 1 AS a, 'x' AS b")
    assert rc == 0 and json.loads(out) == [{"a": 1, "b": "x"}]
    rc, out, _ = run(capsys, "query", "--db", str(db), "--format", "csv", "SELECT 1 AS a, 'x' AS b")
    assert out.splitlines() == ["a,b", "1,x"]
    rc, _, err = run(capsys, "query", "--db", str(db), "SELECT * FROM nowhere")
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "nowhere" in err, err


HEAVY = ("torch", "transformers", "transformer_lens")


def test_query_never_imports_torch(tmp_path):
    """`compatlas query` reads the atlas with duckdb and polars: the table schemas it needs live
    in `compatlas.tables`, so neither the CLI nor the atlas loads torch, transformers or
    transformer_lens (seconds of start-up for a one-line answer). Run in a fresh interpreter:
    this one has long imported torch for other tests."""
    import subprocess
    import sys

    from compatlas.atlas import build_atlas

    db = tmp_path / "atlas.duckdb"
    build_atlas(db, {}, [])
    code = ("import sys\nfrom compatlas import cli\n"
            f"rc = cli.main(['query', '--db', {str(db)!r}, 'SELECT count(*) AS n FROM composition'])\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))\nsys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def test_query_error_keeps_duckdbs_hint_on_one_line(capsys, tmp_path):
    from compatlas.atlas import build_atlas

    db = tmp_path / "atlas.duckdb"
    build_atlas(db, {}, [])
    rc, _, err = run(capsys, "query", "--db", str(db), "SELECT * FROM compositon")
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert "compositon does not exist" in err and 'Did you mean "composition"' in err, err


def test_no_atlas_says_where_it_looked_and_names_db(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside the project folder: results/atlas.duckdb is not here
    rc, _, err = run(capsys, "query", "SELECT 1")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert err.strip() == (f"compatlas: no atlas at {tmp_path / 'results' / 'atlas.duckdb'}; run the pipeline "
                           "first, or name the atlas with --db PATH/results/atlas.duckdb")


def test_tables_round_floats_and_csv_keeps_every_digit(capsys, tmp_path):
    from compatlas.atlas import build_atlas

    df = pl.DataFrame({"score": [0.21848803758621216, 1234567.891, None], "n": [1, 2, 3]})
    assert cli.render_table(df, None).splitlines() == [
        "score       | n", "------------+--", "0.218488    | 1", "1.23457e+06 | 2", "            | 3"]
    db = tmp_path / "atlas.duckdb"
    build_atlas(db, {}, [])
    _rc, out, _ = run(capsys, "query", "--db", str(db), "--format", "csv", "SELECT 0.21848803758621216::DOUBLE AS s")
    assert out.splitlines() == ["s", "0.21848803758621216"]


def test_piped_wide_rows_stay_a_table_and_width_chooses(capsys, tmp_path):
    from compatlas.atlas import build_atlas

    db = tmp_path / "atlas.duckdb"
    build_atlas(db, {}, [])
    wide = "SELECT " + ", ".join(f"{i} AS column_{i}" for i in range(40))
    rc, out, _ = run(capsys, "query", "--db", str(db), wide)  # capsys: stdout is not a terminal
    assert rc == 0 and out.splitlines()[0].startswith("column_0 | column_1 |") and len(out.splitlines()) == 3
    rc, out, _ = run(capsys, "query", "--db", str(db), "--width", "80", wide)
    assert out.splitlines()[0].startswith("-[ row 1 ]") and "column_39 | 39" in out
    rc, out, _ = run(capsys, "query", "--help")
    assert "--width" in out and "csv" in out and "--width 0, or a pipe, always prints a table" in " ".join(out.split())


def test_max_rows_says_how_many_were_left_out(capsys, tmp_path):
    from compatlas.atlas import build_atlas

    db = tmp_path / "atlas.duckdb"
    build_atlas(db, {}, [])
    rc, out, err = run(capsys, "query", "--db", str(db), "--max-rows", "2", "SELECT range AS i FROM range(5)")
    assert rc == 0 and out.splitlines() == ["i", "-", "0", "1", "(more than 2 rows; the first 2 shown: --max-rows)"]
    assert err.strip() == "compatlas: 2 rows shown; the answer has more (--max-rows 2; 0: every row)"
    rc, out, err = run(capsys, "query", "--db", str(db), "--max-rows", "5", "SELECT range AS i FROM range(5)")
    assert rc == 0 and out.splitlines()[-1] == "4" and err.strip() == "compatlas: 5 rows"  # all there: nothing said
    rc, out, _ = run(capsys, "query", "--db", str(db), "--max-rows", "0", "SELECT range AS i FROM range(150)")
    assert rc == 0 and len(out.splitlines()) == 152  # 0: every row


def test_query_warns_of_excluded_shards(capsys, tmp_path):
    from compatlas.atlas import build_atlas
    from compatlas.tables import COMPOSITION_SCHEMA

    shards = []
    for m in ("a", "b"):
        row = {c: None for c in COMPOSITION_SCHEMA} | {"model": m, "score": 0.5}
        shards.append(tmp_path / "composition" / f"{m}.parquet")
        write_shard(pl.DataFrame([row], schema=COMPOSITION_SCHEMA), shards[-1], {})
    shards[1].write_bytes(shards[1].read_bytes()[:30])
    build_atlas(tmp_path / "atlas.duckdb", {"composition": shards}, [])
    rc, out, err = run(capsys, "query", "--db", str(tmp_path / "atlas.duckdb"), "--format", "csv",
                       "SELECT model FROM composition")
    assert rc == 0 and out.splitlines() == ["model", "a"]
    assert err.strip().splitlines() == ["compatlas: warning: 1 result shards are left out of this atlas "
                                        "(SELECT * FROM excluded_shards)", "compatlas: 1 row"]


def test_validate_a_config_that_is_not_a_mapping(capsys, tmp_path):
    bad = tmp_path / "list.yaml"
    bad.write_text("- models\n- metrics\n")
    rc, _, err = run(capsys, "validate", str(bad))
    assert rc == 1 and err.strip() == f"{bad}: a config is a mapping of keys, not a list"


def test_check_shards_without_the_folder(capsys, tmp_path):
    rc, _, err = run(capsys, "check-shards", str(tmp_path / "nowhere"))
    assert rc == 2 and err.strip() == f"compatlas: no folder {tmp_path / 'nowhere'}"


def test_check_shards_adopts_shards_written_before_sealing(capsys, tmp_path):
    old, sealed = tmp_path / "old.parquet", tmp_path / "sealed.parquet"
    pl.DataFrame({"x": [1.0]}).write_parquet(old)  # as shards were written before their checksums
    write_shard(pl.DataFrame({"x": [1.0]}), sealed, {})
    sealed.write_bytes(sealed.read_bytes()[:-9] + b"X" + sealed.read_bytes()[-8:])  # one byte of its footer
    rc, _, err = run(capsys, "check-shards", str(tmp_path))
    assert rc == 1 and "no checksum beside it (old.parquet.sha256)" in err and "sealed.parquet" in err
    rc, _, err = run(capsys, "check-shards", "--adopt", str(tmp_path))
    assert rc == 1 and "1 shards without a checksum adopted" in err and "old.parquet" not in err.splitlines()[-1]
    assert "sealed.parquet is corrupt or truncated (content does not match its checksum" in err  # never adopted


def test_compared_values_of_closed_columns_are_read_from_the_where():
    from compatlas.atlas.query_hints import compared_values, unknown_values

    sql = ("SELECT * FROM composition WHERE model = 'smollm2' AND Comp='k' AND metric IN ('frobenius', 'x''y') "
           "AND space = 'residual' AND score > 0.5")
    assert compared_values(sql) == [("model", "smollm2"), ("comp", "k"), ("metric", "frobenius"), ("metric", "x'y"),
                                     ("space", "residual")]
    lines = unknown_values(sql, ["smollm2-135m", "toy-gpt2"])
    assert lines == ["model 'smollm2' is not in this atlas; it has: smollm2-135m, toy-gpt2",
                     "comp 'k' is not a value of this atlas's vocabulary; it has: Q, K, V",
                     "metric \"x'y\" is not a value of this atlas's vocabulary; it has: frobenius, svd_bound, subspace, contribution, "
                     "pattern_output"]
    assert unknown_values("SELECT * FROM models WHERE model = 'toy-gpt2'", ["toy-gpt2"]) == []


def test_the_hint_names_the_atlas_own_values_and_its_reference_rows():
    """The oracle rows of composition_vs_function (metric oracle_scale / oracle_depth, space oracle) are
    values of the atlas; pattern_output, a metric the default run does not compute, is not."""
    from compatlas.atlas.query_hints import atlas_vocabulary, unknown_values

    paths = ["composition/model=a/checkpoint=final/metric=frobenius/space=residual/block=0.parquet",
             "composition/model=a/checkpoint=final/metric=contribution/space=activation/block=0.parquet",
             "head_scores/model=a/checkpoint=final/heads.parquet"]
    vocab = atlas_vocabulary(paths, [("oracle_scale", "oracle"), ("oracle_depth", "oracle")])
    assert vocab == {"metric": ("frobenius", "contribution", "oracle_depth", "oracle_scale"),
                     "space": ("residual", "activation", "oracle"), "comp": ("Q", "K", "V")}
    sql = "SELECT * FROM composition_vs_function WHERE metric IN ('oracle_scale', 'pattern_output') AND space = 'oracle'"
    assert unknown_values(sql, ["a"], vocab) == [
        "metric 'pattern_output' is not in this atlas; it has: frobenius, contribution, oracle_depth, oracle_scale"]


def test_an_answer_ends_its_line_before_the_row_count(capfd, tmp_path):
    """stdout ends with a newline in every format, so that the count on stderr starts its own line
    (2>&1 in a terminal)."""
    import subprocess
    import sys

    from compatlas.atlas import build_atlas

    db = tmp_path / "atlas.duckdb"
    build_atlas(db, {}, [])
    for fmt in ("table", "csv", "json"):
        out = subprocess.run([sys.executable, "-m", "compatlas.cli", "query", "--db", str(db), "--format", fmt,
                              "SELECT 1 AS a UNION ALL SELECT 2"], capture_output=True, text=True, check=True)
        assert out.stdout.endswith("\n") and out.stderr == "compatlas: 2 rows\n", (fmt, out)


def test_every_answer_says_its_row_count_and_an_unknown_model(capsys, tmp_path):
    """An empty answer for a misspelt model says so, naming the models there are; a real empty
    answer only counts its rows."""
    from compatlas.atlas import build_atlas

    db = tmp_path / "atlas.duckdb"
    build_atlas(db, {}, [])
    rc, _, err = run(capsys, "query", "--db", str(db), "SELECT * FROM composition WHERE model = 'smollm2'")
    assert rc == 0 and "compatlas: note: model 'smollm2' is not in this atlas; it has: none" in err
    assert err.strip().splitlines()[-1] == "compatlas: 0 rows"
    rc, _out, err = run(capsys, "query", "--db", str(db), "SELECT 1 AS a UNION ALL SELECT 2")
    assert rc == 0 and err.strip().splitlines() == ["compatlas: 2 rows"]
