"""`compatlas` command line: query the atlas, validate a config, check shards."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXAMPLES = """examples:
  compatlas query "SELECT * FROM models"
  compatlas query "SELECT writer_layer, writer_head, reader_layer, reader_head, score,
                   score - baseline_spectrum_mean AS adjusted FROM composition
                   WHERE model = 'smollm2-135m' AND metric = 'frobenius' AND comp = 'K'
                   ORDER BY adjusted DESC LIMIT 10"
  compatlas validate config/config.yaml
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="compatlas", description=__doc__, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("query", help="run SQL against results/atlas.duckdb")
    q.add_argument("sql")
    q.add_argument("--db", default="results/atlas.duckdb")
    q.add_argument("--format", choices=["table", "csv", "json"], default="table")
    q.add_argument("--max-rows", type=int, default=100)
    v = sub.add_parser("validate", help="validate a config file against the schema")
    v.add_argument("config", nargs="?", default="config/config.yaml")
    c = sub.add_parser("check-shards", help="open every Parquet shard under a folder")
    c.add_argument("folder", nargs="?", default="results/composition")
    args = p.parse_args(argv)

    if args.cmd == "query":
        import polars as pl

        from compatlas.atlas import query

        if not Path(args.db).exists():
            print(f"compatlas: no atlas at {args.db}; run the pipeline first (see README)", file=sys.stderr)
            return 2
        try:
            df = query(args.db, args.sql)
        except Exception as e:
            print(f"compatlas: query failed: {e}", file=sys.stderr)
            return 1
        if args.format == "csv":
            df.write_csv(sys.stdout)
        elif args.format == "json":
            sys.stdout.write(df.write_json())
        else:
            with pl.Config(tbl_rows=args.max_rows, tbl_cols=-1, fmt_str_lengths=60, tbl_width_chars=200):
                print(df)
        return 0
    if args.cmd == "validate":
        import yaml

        from compatlas.config import ConfigError, validate_config

        try:
            validate_config(yaml.safe_load(Path(args.config).read_text()) or {})
        except ConfigError as e:
            print(f"{args.config}: {e}", file=sys.stderr)
            return 1
        print(f"{args.config}: valid")
        return 0
    if args.cmd == "check-shards":
        from compatlas.storage import check_shards

        shards = sorted(Path(args.folder).rglob("*.parquet"))
        check_shards(shards)
        print(f"{len(shards)} shards open cleanly")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
