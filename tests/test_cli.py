"""The command line: one line per error, the views listed in `query --help`, readable tables."""

from __future__ import annotations

import json

import polars as pl
import pytest

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


def test_check_shards_names_the_bad_shard_in_one_line(capsys, tmp_path):
    good, bad = tmp_path / "a" / "good.parquet", tmp_path / "a" / "bad.parquet"
    write_shard(pl.DataFrame({"x": [1.0, 2.0]}), good, {})
    write_shard(pl.DataFrame({"x": [1.0, 2.0]}), bad, {})
    bad.write_bytes(bad.read_bytes()[:40])
    rc, _, err = run(capsys, "check-shards", str(tmp_path))
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert str(bad) in err and "corrupt or truncated" in err
    bad.unlink()
    rc, out, _ = run(capsys, "check-shards", str(tmp_path))
    assert rc == 0 and out.strip() == "1 shards open cleanly"


def test_query_help_lists_every_view_the_atlas_has(capsys, tmp_path):
    from compatlas.atlas import build_atlas, query

    db = tmp_path / "atlas.duckdb"
    build_atlas(db, {}, [])
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
