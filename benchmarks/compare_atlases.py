"""Whether two atlases hold the same rows: every table and view of the first, compared with the
second's both ways (``EXCEPT ALL``), and the names each has that the other lacks.

    python benchmarks/compare_atlases.py A.duckdb B.duckdb
"""

from __future__ import annotations

import sys

import duckdb
import pyarrow as pa

from compatlas.atlas import connect


def names(con: duckdb.DuckDBPyConnection) -> set[str]:
    rows = con.execute("SELECT table_name FROM duckdb_tables() WHERE database_name = current_database() "
                       "UNION SELECT view_name FROM duckdb_views() WHERE NOT internal "
                       "AND database_name = current_database()").fetchall()
    return {r[0] for r in rows}


def table(con: duckdb.DuckDBPyConnection, name: str) -> pa.Table:
    got = con.sql(f"SELECT * FROM {name}").arrow()
    return got.read_all() if isinstance(got, pa.RecordBatchReader) else got  # a reader in newer DuckDB


def float_gaps(cmp: duckdb.DuckDBPyConnection, ta: pa.Table) -> str:
    """The largest |a - b| and relative gap of each float column, rows matched on the other columns
    (``ta`` and ``tb`` registered on ``cmp``): a difference in the last bits (summation order) or not."""
    floats = [f.name for f in ta.schema if pa.types.is_floating(f.type)]
    keys = [f.name for f in ta.schema if f.name not in floats and not pa.types.is_list(f.type)]
    on = " AND ".join(f"a.{k} IS NOT DISTINCT FROM b.{k}" for k in keys)
    gaps = ", ".join(f"max(abs(a.{c} - b.{c})) FILTER (WHERE NOT isnan(a.{c} - b.{c})), "
                     f"max(abs(a.{c} - b.{c}) / greatest(abs(a.{c}), abs(b.{c}))) FILTER (WHERE abs(a.{c} - b.{c}) > 0)"
                     for c in floats)
    matched = cmp.execute(f"SELECT count(*), {gaps} FROM ta a JOIN tb b ON {on}").fetchall()[0]
    out = [f"{matched[0]} rows matched on {len(keys)} key columns"]
    out += [f"{c} {matched[1 + 2 * i]:.3g} (rel {matched[2 + 2 * i]:.3g})" for i, c in enumerate(floats)
            if matched[1 + 2 * i]]
    return "; ".join(out)


def main(a: str, b: str) -> int:
    ca, cb = connect(a), connect(b)
    na, nb = names(ca), names(cb)
    bad = 0
    for only, n in ((na - nb, a), (nb - na, b)):
        if only:
            print(f"only in {n}: {sorted(only)}")
            bad += 1
    cmp = duckdb.connect()
    for name in sorted(na & nb):
        ta, tb = (table(c, name) for c in (ca, cb))
        cmp.register("ta", ta)
        cmp.register("tb", tb)
        ab = cmp.execute("SELECT count(*) FROM (SELECT * FROM ta EXCEPT ALL SELECT * FROM tb)").fetchall()[0][0]
        ba = cmp.execute("SELECT count(*) FROM (SELECT * FROM tb EXCEPT ALL SELECT * FROM ta)").fetchall()[0][0]
        same = ab == 0 and ba == 0 and ta.num_rows == tb.num_rows
        bad += not same
        print(f"{'same' if same else 'DIFF'} {name}: {ta.num_rows} / {tb.num_rows} rows, {ab} only in a, {ba} only in b")
        if not same:
            print("   ", float_gaps(cmp, ta))
    print("identical" if not bad else f"{bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
