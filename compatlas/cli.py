"""`compatlas` command line: query the atlas, validate a config, check shards."""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import threading
from pathlib import Path

EXAMPLES = """examples:
  compatlas query "SELECT * FROM models"
  compatlas query "SELECT writer_layer, writer_head, reader_layer, reader_head, score,
                   score - baseline_spectrum_mean AS adjusted FROM composition
                   WHERE model = 'smollm2-135m' AND metric = 'frobenius' AND comp = 'K'
                   ORDER BY adjusted DESC LIMIT 10"
  compatlas validate config/config.yaml
"""


# What `query --help` lists (tests/test_cli.py checks it against the views a built atlas has).
TABLES = {
    "models": "one row per model x checkpoint: shapes, steps, source, revision, commit, checksums",
    "checkpoints": "each model's checkpoints with their step, in order; latest marks the last one",
    "composition": "every writer/reader head pair's score per metric, space and comp, with its nulls",
    "composition_null": "the same scores for non-causal pairs (the empirical null)",
    "composition_z": "composition plus z-scores, p- and q-values",
    "calibration": "p- and q-values of the causal pairs against the null pairs",
    "discoveries": "composition_z rows with q_value <= composition.fdr",
    "discovery_floor": "per cell with discoveries: how many sit at the null's floor 1/(N+1), and whether one fewer would undo them",
    "invariance": "rank stability of every metric and space under weight transforms",
    "metric_audit": "every metric and space against the axioms",
    "induction_tokens": "induction strength per token and role (A/B), with nearby-B and random controls",
    "induction_summary": "induction strength per model x checkpoint x filler setting x role",
    "head_scores": "previous-token, duplicate and induction attention, and ablation drop per head",
    "reader_best_composition": "each reader head's strongest composition with a previous-token head",
    "composition_vs_behaviour": "how well each metric picks out the induction heads (Spearman, AUROC)",
    "edge_attribution": "each writer -> reader edge per comp scored by its effect on induction (EAP, EAP-IG, exact)",
    "eap_vs_exact": "how well the attribution estimates agree with exact edge patching",
    "circuit_edge_rank": "the K edge exact patching ranks first: its rank by composition among its reader's edges, per cell and checkpoint",
    "composition_vs_function": "which composition score predicts the edges that matter (Spearman, AUROC, precision)",
    "function_agreement": "per comp and cell: the function figures the report shows, with bootstrap intervals and verdicts",
    "function_bootstrap": "the same bootstrap's replicates per comp and cell (paired differences between cells)",
    "training_loss": "the loss of the pipeline's own training runs, per step",
    "excluded_shards": "result shards left out of the views: missing, truncated, or failing their checksum",
    "shard_files": "every shard the views read, with its size, mtime and sha256 as verified at the build",
}
QUERY_HELP = "tables and views:\n" + "\n".join(f"  {k:<26} {v}" for k, v in TABLES.items()) + \
    "\n\ncolumns: compatlas query \"DESCRIBE composition\"; schema: docs/schema.md"


DIGITS = 6  # significant digits of a float in a table (csv and json keep every digit)
TABLE_HELP = ("table: aligned columns, floats to 6 significant digits; a row wider than the terminal prints "
              "as one block per row (psql's expanded mode). --width 0, or a pipe, always prints a table; "
              "csv and json keep every digit, and csv writes a list, struct or map as its JSON")


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.{DIGITS}g}"
    return str(v)


def render_table(df, max_width: int | None) -> str:
    """A table as text: aligned columns when it fits in ``max_width`` characters (``None``: no
    limit), else one block per row of ``column | value`` lines (as psql's expanded mode), never
    columns wrapped to slivers. Floats are rounded to ``DIGITS`` significant digits."""
    cols = df.columns
    rows = [[_cell(v) for v in r] for r in df.iter_rows()]
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(cols)]
    if max_width is None or sum(widths) + 3 * max(len(cols) - 1, 0) <= max_width:
        line = lambda vals: " | ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()  # noqa: E731
        sep = "-+-".join("-" * w for w in widths)
        return "\n".join([line(cols), sep] + [line(r) for r in rows])
    name_w = max(map(len, cols), default=0)
    out = []
    for n, r in enumerate(rows, 1):
        out.append(f"-[ row {n} ]" + "-" * max(0, name_w - 6))
        out += [f"{c.ljust(name_w)} | {v}" for c, v in zip(cols, r)]
    return "\n".join(out)


def error_line(e: BaseException) -> str:
    """DuckDB's error on one line: its first line, and its hint where it gives one ("Did you mean
    ...", "Candidate bindings: ...") on the lines after it."""
    lines = [s.strip() for s in str(e).strip().splitlines() if s.strip()]
    if not lines:
        return type(e).__name__
    hints = [s for s in lines[1:] if s.startswith(("Did you mean", "Candidate bindings"))]
    return " ".join(lines[:1] + hints)


class _Warnings(logging.Handler):
    """The atlas's warnings while a query runs, each kept once (the CLI prints them after it)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self.said: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        if (line := record.getMessage()) not in self.said:
            self.said.add(line)
            self.lines.append(line)

    def flush(self) -> None:
        """Print the warnings kept since the last flush (each warning only ever once)."""
        for line in self.lines:
            print(f"compatlas: warning: {line}", file=sys.stderr)
        self.lines.clear()


def _count(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a count of rows (0: every row)")
    return n


def _seconds(text: str) -> float:
    t = float(text)
    if not t > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a time in seconds above 0")
    return t


def _answer(con, sql: str, fmt: str, max_rows: int, width: int | None, progress: list[int],
            stopping: threading.Event) -> tuple[int, bool]:
    """Write ``sql``'s answer to stdout in ``fmt``: (rows written, whether ``max_rows`` (0: no
    limit) cut some). A table is fetched whole, up to ``max_rows``, to align it; CSV and JSON
    without a limit are written a batch at a time, counted in ``progress`` as they go."""
    from compatlas.atlas.running import batches, first_rows, printable

    if fmt == "table" or max_rows:
        df, cut = first_rows(con, sql, max_rows) if max_rows else (con.sql(sql).pl(), False)
        if fmt == "table":
            print(render_table(df, width))
            if cut:
                print(f"(more than {max_rows} rows; the first {max_rows} shown: --max-rows)")
        elif fmt == "csv":
            printable(df, fmt).write_csv(sys.stdout)
        else:
            sys.stdout.write(printable(df, fmt).write_json() + "\n")
        return df.height, cut
    for df in batches(con, sql, stopping):
        if fmt == "csv":
            printable(df, fmt).write_csv(sys.stdout, include_header=not progress)
        else:  # one JSON array, written a batch of its objects at a time
            body = printable(df, fmt).write_json()[1:-1]
            sys.stdout.write(("[" if not progress else "," if body and sum(progress) else "") + body)
        progress.append(df.height)
        sys.stdout.flush()
    if fmt == "json":
        sys.stdout.write("]\n")
    return sum(progress), False


def _query(args: argparse.Namespace) -> int:
    """``compatlas query``: its answer on stdout, and on stderr what connecting found (once
    each), the shards left out, notes on values the atlas cannot hold and the row count."""
    from compatlas.atlas.database import query_connection
    from compatlas.atlas.files import AtlasChanged, last_good_path
    from compatlas.atlas.query_guard import RefusedStatement, check_read_only, sql_text
    from compatlas.atlas.query_hints import row_count
    from compatlas.atlas.running import INTERRUPTED, Stopped, interruptible

    if not Path(args.db).exists() and not last_good_path(args.db).exists():
        print(f"compatlas: no atlas at {Path(args.db).absolute()}; run the pipeline first, or name "
              "the atlas with --db PATH/results/atlas.duckdb", file=sys.stderr)
        return 2
    width = args.width if args.width is not None else (
        shutil.get_terminal_size((120, 24)).columns if sys.stdout.isatty() else 0)
    max_rows = args.max_rows if args.max_rows is not None else (100 if args.format == "table" else 0)
    said = _Warnings()  # what connecting found (a WAL, a changed or missing atlas, a changed shard)
    logging.getLogger("compatlas").addHandler(said)
    progress: list[int] = []  # rows of each batch written so far (csv, json)
    try:
        sql = sql_text(args.sql)
        check_read_only(sql)
        with query_connection(args.db) as con:
            said.flush()
            for line in _context(con, sql):
                print(f"compatlas: {line}", file=sys.stderr)
            n, cut = interruptible(con, lambda stopping: _answer(con, sql, args.format, max_rows, width or None,
                                                                 progress, stopping), args.timeout)
    except (RefusedStatement, AtlasChanged) as e:
        print(f"compatlas: {e}", file=sys.stderr)
        return 1
    except Stopped as e:
        part = f"; the {sum(progress)} rows written before it are not the whole answer" if progress else ""
        print(f"compatlas: {e}{part}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:  # Ctrl-C before or after the query ran (while it runs: Stopped)
        print("compatlas: query stopped by Ctrl-C", file=sys.stderr)
        return INTERRUPTED
    except Exception as e:  # noqa: BLE001 - any error of DuckDB's or the SQL's: one line, not a traceback
        print(f"compatlas: query failed: {error_line(e)}", file=sys.stderr)
        return 1
    finally:
        logging.getLogger("compatlas").removeHandler(said)
        said.flush()
    sys.stdout.flush()  # the answer, then what is said after it, in that order on a terminal
    print(f"compatlas: {row_count(n)}" + (f" shown; the answer has more (--max-rows {max_rows}; 0: every row)"
                                            if cut else ""), file=sys.stderr)
    return 0


def _context(con, sql: str) -> list[str]:
    """What ``compatlas query`` says before an answer: the shards the atlas leaves out, and each
    value a WHERE compares a closed-set column with that the atlas cannot hold."""
    from compatlas.atlas.query_hints import CLOSED, atlas_vocabulary, unknown_values

    lines = []
    try:  # shards the atlas left out (truncated, corrupt): said beside every answer
        excluded = con.execute("SELECT count(*) FROM excluded_shards").fetchall()[0][0]
    except Exception:  # noqa: BLE001 -- an atlas built before the table existed
        excluded = 0
    if excluded:
        lines.append(f"warning: {excluded} result shards are left out of this atlas (SELECT * FROM excluded_shards)")
    try:
        models = [r[0] for r in con.execute("SELECT DISTINCT model FROM models ORDER BY model").fetchall()]
    except Exception:  # noqa: BLE001 -- an atlas without a models table: no model names to check
        models = []
    closed = CLOSED
    try:  # the values this atlas holds, from its shards' paths and its reference rows (the oracles)
        paths = [r[0] for r in con.execute("SELECT path FROM shard_files").fetchall()]
        refs = [(m, s) for m, s in con.execute("SELECT DISTINCT metric, space FROM composition_vs_function").fetchall()]
        if paths:
            closed = atlas_vocabulary(paths, refs)
    except Exception:  # noqa: BLE001 -- an atlas built before these tables: the vocabulary's values
        pass
    return lines + [f"note: {line}" for line in unknown_values(sql, models, closed)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="compatlas", description=__doc__, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("query", help="run SQL against results/atlas.duckdb", epilog=QUERY_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("sql")
    q.add_argument("--db", default="results/atlas.duckdb",
                   help="the atlas (default: results/atlas.duckdb under the folder you run in)")
    q.add_argument("--format", choices=["table", "csv", "json"], default="table", help=TABLE_HELP)
    q.add_argument("--width", type=int, default=None,
                   help="widest table before rows print as blocks (default: the terminal's; 0: no limit)")
    q.add_argument("--max-rows", type=_count, default=None,
                   help="the most rows fetched and shown; only these are computed where the query allows "
                        "(a LIMIT is put around it), and the output says when rows were cut (default: 100 for a "
                        "table, every row for csv and json, written as they come; 0: every row)")
    q.add_argument("--timeout", type=_seconds, default=None, metavar="SECONDS",
                   help="stop the query after this long (exit status 124); Ctrl-C stops it at once (exit status 130)")
    v = sub.add_parser("validate", help="validate a config file against the schema")
    v.add_argument("config", nargs="?", default="config/config.yaml")
    c = sub.add_parser("check-shards", help="verify every Parquet shard under a folder against its checksum")
    c.add_argument("folder", nargs="?", default="results")
    c.add_argument("--set-aside", action="store_true",
                   help="move each bad shard to results/quarantine/, so that the next snakemake run remakes it")
    c.add_argument("--adopt", action="store_true",
                   help="write the checksum of each shard that has none (written before shards were sealed), "
                        "trusting it as it is now, instead of remaking it")
    args = p.parse_args(argv)

    if args.cmd == "query":
        return _query(args)
    if args.cmd == "validate":
        import yaml

        from compatlas.plan import build_plan
        from compatlas.plan.config import ConfigError, load_config_file

        try:
            config = load_config_file(args.config) or {}
        except ConfigError as e:
            print(f"{args.config}: {e}", file=sys.stderr)
            return 1
        except OSError as e:
            print(f"{args.config}: cannot read it: {e.strerror or e}", file=sys.stderr)
            return 1
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            print(f"{args.config}: not valid YAML{where}: {getattr(e, 'problem', None) or e}", file=sys.stderr)
            return 1
        if not isinstance(config, dict):
            print(f"{args.config}: a config is a mapping of keys, not a {type(config).__name__}", file=sys.stderr)
            return 1
        try:
            plan = build_plan(config, check_hub=True)
        except ConfigError as e:
            print(f"{args.config}: {e}", file=sys.stderr)
            return 1
        for note in plan.notes:
            print(f"{args.config}: note: {note}", file=sys.stderr)
        print(f"{args.config}: valid")
        return 0
    if args.cmd == "check-shards":
        from compatlas.storage import QUARANTINE, bad_shards, seal, set_aside

        folder = Path(args.folder)
        if not folder.is_dir():
            print(f"compatlas: no folder {args.folder}", file=sys.stderr)
            return 2
        shards = sorted(p for p in folder.rglob("*.parquet") if QUARANTINE not in p.relative_to(folder).parts)
        bad = bad_shards(shards)
        if args.adopt:  # results from before shards were sealed: trusted as they are (an explicit choice)
            unsealed = [p for p, err in bad.items() if err.startswith("no checksum")]
            for shard in unsealed:
                seal(Path(shard), shard)
                del bad[shard]
            print(f"{len(unsealed)} shards without a checksum adopted as they are", file=sys.stderr)
        # results/: the folder (or the first above it) holding an atlas; the pipeline looks there
        results = next((q for q in (folder.resolve(), *folder.resolve().parents)
                        if (q / "atlas.duckdb").exists() or (q / ".atlas.last-good.duckdb").exists()), folder.resolve())
        for path, err in bad.items():
            if args.set_aside:
                print(f"compatlas: result shard {path} is corrupt or truncated ({err}); set aside as "
                      f"{set_aside(path, results)}; the next snakemake run remakes it", file=sys.stderr)
            else:
                print(f"compatlas: result shard {path} is corrupt or truncated ({err}); set it aside with "
                      f"compatlas check-shards --set-aside {args.folder}, then rerun snakemake", file=sys.stderr)
        if bad:
            return 1
        print(f"{len(shards)} shards match their checksums")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
