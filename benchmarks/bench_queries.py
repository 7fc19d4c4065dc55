"""Every query the documentation shows, and every table and view whole, timed on an atlas.

    python benchmarks/bench_queries.py [results/atlas.duckdb] [--limit 2.0]

The queries are read from README.md and docs/*.md: each ```sql block, and each
``compatlas query "..."`` of a shell block. Beside them, ``SELECT count(*)`` of every table and
view of the atlas (what aggregating over every row costs) and
``SELECT * FROM composition_vs_function WHERE model = 'smollm2-135m'``. Each runs on a fresh
read-only connection (``compatlas.atlas.connect``: the time a user waits, the connection's
opening included), best of 3; the last column is the time against ``--limit`` (the target:
every query in <= 2 s on the default atlas). Exit 1 when one is over the limit.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from compatlas.atlas import connect

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)
CLI = re.compile(r'compatlas query\s+(?:--\S+\s+(?:\S+\s+)?)*"(.*?)"', re.S)


def documented_queries() -> list[tuple[str, str]]:
    """(where, SQL) of every query in README.md and docs/*.md."""
    out = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for lang, body in FENCE.findall(doc.read_text()):
            if lang == "sql":
                out.append((doc.name, body.strip()))
            elif lang in ("bash", "sh", "console", ""):
                out += [(doc.name, q.strip()) for q in CLI.findall(body)]
    return out


def timed(atlas: Path, sql: str, repeats: int = 3) -> tuple[float, int]:
    best, rows = float("inf"), 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        con = connect(atlas)
        rows = len(con.execute(sql).fetchall())
        con.close()
        best = min(best, time.perf_counter() - t0)
    return best, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("atlas", nargs="?", default="results/atlas.duckdb", type=Path)
    ap.add_argument("--limit", type=float, default=2.0)
    args = ap.parse_args()
    con = connect(args.atlas)
    relations = [r[0] for r in con.execute("SELECT DISTINCT table_name FROM information_schema.tables ORDER BY table_name").fetchall()]
    con.close()
    queries = documented_queries()
    queries += [("(count)", f"SELECT count(*) FROM {r}") for r in relations]
    queries.append(("(issue 38)", "SELECT * FROM composition_vs_function WHERE model = 'smollm2-135m'"))
    over = 0
    print(f"{'seconds':>8} {'rows':>7} {'x limit':>8}  where: query")
    for where, sql in queries:
        try:
            s, rows = timed(args.atlas, sql)
        except Exception as e:  # noqa: BLE001 (a documented query that fails is reported, not fatal)
            print(f"{'error':>8} {'':>7} {'':>8}  {where}: {' '.join(sql.split())[:90]}  ({type(e).__name__}: {e})")
            over += 1
            continue
        over += s > args.limit
        print(f"{s:8.3f} {rows:7d} {s / args.limit:8.2f}  {where}: {' '.join(sql.split())[:100]}")
    print(f"{len(queries)} queries, {over} over {args.limit} s or failing")
    sys.exit(1 if over else 0)


if __name__ == "__main__":
    main()
