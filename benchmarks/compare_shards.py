"""Compare every Parquet shard of two result folders: a refactor must leave the data alone.

    python benchmarks/compare_shards.py BASE_DIR NEW_DIR

One line per shard (its path relative to the folders): ``same`` when the two have the same
columns, dtypes and values (polars ``DataFrame.equals``, nulls equal, floats exactly), else
what differs; and, either way, the Parquet metadata keys whose values differ (the provenance,
one JSON object, key by key: library versions and timings are expected to). Shards present in one folder only are
listed. Exit 1 on any data difference or missing shard, 0 otherwise (metadata differences
alone do not fail).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow.parquet as pq


def metadata(path: Path) -> dict[str, Any]:
    """The key-value metadata of a Parquet file, decoded; a value that is a JSON object (compatlas
    writes its provenance as one, under ``compatlas``) is opened one level, its keys named
    ``compatlas.<key>``. The schema blob pyarrow adds is left out."""
    raw = pq.read_metadata(path).metadata or {}
    out: dict[str, Any] = {}
    for k, v in raw.items():
        if k == b"ARROW:schema":
            continue
        key, text = k.decode(), v.decode(errors="replace")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        if isinstance(value, dict):
            out.update({f"{key}.{inner}": json.dumps(x, sort_keys=True) for inner, x in value.items()})
        else:
            out[key] = text
    return out


def compare(base: Path, new: Path) -> tuple[bool, str]:
    """(data equal, one line saying how) for one shard in the two folders."""
    a, b = pl.read_parquet(base), pl.read_parquet(new)
    problems = []
    if a.columns != b.columns:
        problems.append(f"columns {a.columns} != {b.columns}")
    elif a.dtypes != b.dtypes:
        problems.append(f"dtypes {[str(d) for d in a.dtypes]} != {[str(d) for d in b.dtypes]}")
    elif a.shape != b.shape:
        problems.append(f"shape {a.shape} != {b.shape}")
    elif not a.equals(b, null_equal=True):
        cols = [c for c in a.columns if not a[c].equals(b[c], check_names=True, null_equal=True)]
        problems.append(f"values differ in {cols}")
    ma, mb = metadata(base), metadata(new)
    keys = sorted(k for k in ma.keys() | mb.keys() if ma.get(k) != mb.get(k))
    meta = f"metadata differs: {', '.join(keys)}" if keys else "metadata same"
    return not problems, ("DIFF " + "; ".join(problems) if problems else "same") + f" ({a.height} rows; {meta})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", type=Path, help="the reference results folder")
    ap.add_argument("new", type=Path, help="the results folder to check against it")
    args = ap.parse_args(argv)
    shards = {p.relative_to(args.base) for p in args.base.rglob("*.parquet")}
    others = {p.relative_to(args.new) for p in args.new.rglob("*.parquet")}
    ok = True
    for rel in sorted(shards | others):
        if rel not in others or rel not in shards:
            ok = False
            print(f"{rel}: MISSING in {'new' if rel not in others else 'base'}")
            continue
        same, line = compare(args.base / rel, args.new / rel)
        ok &= same
        print(f"{rel}: {line}")
    print(f"{len(shards | others)} shards: {'data identical' if ok else 'DATA DIFFERS'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
