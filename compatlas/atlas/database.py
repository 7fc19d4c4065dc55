"""The DuckDB atlas: views over the Parquet shards, and the extraction metadata as `models`.

Rebuilding is cheap (no data is copied): the views read the shards in place. The file is
built under a temporary name and renamed, so readers never see a half-built database.

Relocatable, and open to plain DuckDB: the views name their shards relative to the folder that
holds the database's folder, through that folder's name (``results/composition/...``). DuckDB
resolves relative paths against the working directory, so ``duckdb.connect("results/atlas.duckdb")``
and the DuckDB CLI answer from the project folder with nothing set; anywhere else one line does
it, ``SET file_search_path = '<the folder holding results/>'`` (``SEARCH_PATH_HINT``). ``connect``
sets it itself, so a copied or moved ``results/`` keeps working (renamed too: see ``connect``).

Written in DuckDB's v1.0.0 storage format (``STORAGE_VERSION``): the atlas is views and two small
tables, which every DuckDB from 1.0 on reads, where a file in the newest format is refused by
DuckDB 1.x ("Trying to read a database file with version number ...").

A shard that fails its checksum or does not open (truncated, corrupt) is set aside under
``results/quarantine/`` (the next run remakes it) and left out of its view with a warning in the
log and a row in the ``excluded_shards`` table (view, path, error), rather than failing the
build: one bad shard would otherwise break every query of its view, and a failed atlas job
loses the previous ``atlas.duckdb`` (Snakemake removes a job's outputs before it runs). Each
build also leaves a copy of itself (``last_good_path``) that queries fall back on meanwhile.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any

import duckdb
import polars as pl

from compatlas.atlas.files import PRIVATE, last_good_path, private_copy, private_folder, readable, set_aside_sessions
from compatlas.atlas.query_guard import check_read_only, lock_down, sql_text
from compatlas.storage import (
    atomic_path,
    bad_shards,
    checksum_path,
    read_provenance,
    read_sealed_json,
    seal,
    set_aside,
    shard_error,
)
from compatlas.tables import EXCLUDED_SHARDS_SCHEMA, MODELS_SCHEMA, SHARD_VIEWS

log = logging.getLogger(__name__)

# Views derived from the ones over shards (SQL, so they follow the shards whenever the atlas is
# rebuilt), in the order they are created: each reads only views before it (checkpoints reads only
# the models table, and is created before the shard views, which join it for ``latest``). The SQL of each is
# views/<name>.sql beside this module; {fdr}, {prev} and {ind} in it are build_atlas's thresholds,
# {min_readers} and {min_class} the counts below which a statistic is NULL (MIN_READERS, MIN_CLASS).
DERIVED_VIEWS = ("checkpoints", "composition_z", "discoveries", "discovery_floor", "induction_summary", "reader_best_composition",
                 "composition_vs_behaviour", "composition_vs_function", "eap_vs_exact", "circuit_edge_rank")
# Of those, the ones stored as tables when the atlas is built (their SQL stays the definition):
# each aggregates every edge of every metric x space, tens of seconds a query as a view.
MATERIALISED = ("composition_vs_function",)


# The oldest storage format that holds what the atlas holds: DuckDB 1.0 and later read it.
STORAGE_VERSION = "v1.0.0"
# What the views' comment says, and what a plain DuckDB user outside the project folder runs first.
SEARCH_PATH_HINT = "SET file_search_path = '{parent}'"
_BASE_COMMENT = re.compile(r"shard paths are relative to the folder holding '([^']*)/'")


# composition_vs_behaviour gives no Spearman from fewer readers than this (2 readers give +-1), and
# no AUROC unless the induction heads and the other readers number at least MIN_CLASS each; the
# report shows these NULLs as they are, beside the counts.
MIN_READERS = 10
MIN_CLASS = 3


def derived_view_sql(name: str, fdr: float, prev: float, ind: float) -> str:
    """The ``CREATE VIEW`` statement of a derived view, as in its file, its thresholds filled in."""
    sql = resources.files("compatlas.atlas").joinpath("views", f"{name}.sql").read_text(encoding="utf-8")
    return sql.format(fdr=float(fdr), prev=float(prev), ind=float(ind), min_readers=MIN_READERS, min_class=MIN_CLASS)


def create_derived_view(con: duckdb.DuckDBPyConnection, name: str, fdr: float, prev: float, ind: float) -> None:
    """Create a derived view (a table for a ``MATERIALISED`` one) from ``derived_view_sql``, with
    ``latest`` added (``with_latest``) where it has a checkpoint and its SQL does not carry the flag
    already: created as a view first, which binds it (its columns) without computing it."""
    sql = derived_view_sql(name, fdr, prev, ind)
    con.execute(sql)
    flag = needs_latest(r[0] for r in con.execute(f"DESCRIBE {name}").fetchall())
    if flag or name in MATERIALISED:
        head = f"CREATE VIEW {name} AS"
        body = re.sub(r";\s*\Z", "", sql[sql.index(head) + len(head):])
        con.execute(f"DROP VIEW {name}")
        con.execute(f"CREATE {'TABLE' if name in MATERIALISED else 'VIEW'} {name} AS {with_latest(body) if flag else body}")


_DUCK_TYPES = {pl.Utf8: "VARCHAR", pl.Int32: "INTEGER", pl.Int64: "BIGINT", pl.Float64: "DOUBLE", pl.Boolean: "BOOLEAN"}


def models_frame(meta_paths: list[str | os.PathLike]) -> pl.DataFrame:
    """The ``models`` table: a row per extraction metadata file (``tables.MODELS_SCHEMA``)."""
    rows: list[dict[str, Any]] = []
    for p in meta_paths:
        meta = read_sealed_json(p)  # unchanged since written, in its model's folder
        row = {c: meta.get(c) for c in MODELS_SCHEMA}
        row["versions"] = json.dumps(meta.get("versions", {}), sort_keys=True)
        row["norm_gains"] = json.dumps(meta.get("norm_gains", {}), sort_keys=True)  # {} : no QK- or sandwich norm
        row["quantized"] = bool(meta.get("quantized", False))
        rows.append(row)
    return pl.DataFrame(rows, schema=MODELS_SCHEMA)


def needs_latest(columns: Iterable[str]) -> bool:
    """Whether a view or table of these columns gets ``latest`` (``with_latest``): it has a
    checkpoint and does not carry the flag already."""
    cols = set(columns)
    return {"model", "checkpoint"} <= cols and "latest" not in cols


def with_latest(select: str) -> str:
    """``select`` (a query with ``model`` and ``checkpoint`` columns) with the ``checkpoints``
    view's ``latest`` flag added as its last column: "the last checkpoint of each model" is
    ``WHERE latest`` in every view that has a checkpoint."""
    return f"SELECT v.*, k.latest FROM (\n{select}\n) v LEFT JOIN checkpoints k USING (model, checkpoint)"


def stale_shards(paths: Sequence[str | os.PathLike], weights: Mapping[tuple[str, str], str]) -> dict[str, str]:
    """path -> why, for the sound shards computed from other weights than their model x checkpoint's
    extraction now holds (``weights``: its ``weights_sha256``), as their provenance records: a shard
    of an earlier extraction, or copied from another results folder, would mix two models' numbers."""
    out = {}
    for p in paths:  # sound ones (bad_shards passed them): their footers read
        record = read_provenance(p)
        key, made_from = (str(record.get("model")), str(record.get("checkpoint"))), record.get("weights_sha256")
        if made_from and key in weights and weights[key] != made_from:
            out[str(p)] = (f"computed from other weights than {key[0]}/{key[1]}'s extraction (weights_sha256 "
                           f"{made_from[:12]}..., the extraction's {weights[key][:12]}...)")
    return out


def _parquet_view(name: str, shards: Sequence[str | os.PathLike], types: dict, root: Path | None = None,
                  temp: bool = False, present: set[str] | None = None, latest: bool = True) -> str:
    """The view over ``shards``, with ``latest`` (``with_latest``) where its shards have a checkpoint
    (and ``latest`` is asked for: an atlas built before the ``checkpoints`` view has none);
    ``present``: the columns some shard has (read from their footers when not given)."""
    columns = list(types)
    create = "CREATE TEMP VIEW" if temp else "CREATE VIEW"
    flagged = with_latest if latest and needs_latest(types) else (lambda q: q)
    if not shards:  # an empty, typed view keeps queries valid before the first results
        cols = ", ".join(f"NULL::{_DUCK_TYPES[types[c]]} AS {c}" for c in columns)
        return f"{create} {name} AS {flagged(f'SELECT {cols} WHERE false')}"

    def where(s) -> str:  # "results/composition/..." when the shard is inside the database's folder
        p = Path(s).resolve()
        return (Path(root.name) / p.relative_to(root)).as_posix() if root is not None and p.is_relative_to(root) else str(p)

    files = ", ".join("'" + where(s).replace("'", "''") + "'" for s in sorted(map(str, shards)))
    # a column added to a schema since older shards were written reads as NULL there (union_by_name);
    # where no shard has it yet, it is typed NULL, not an error
    if present is None:
        absolute = ", ".join("'" + str(Path(s).resolve()).replace("'", "''") + "'" for s in shards)
        footers = duckdb.sql(f"SELECT DISTINCT name FROM parquet_schema([{absolute}])")
        assert footers is not None  # a SELECT always gives a relation (None is for statements without rows)
        present = {r[0] for r in footers.fetchall()}
    sel = ", ".join(c if c in present else f"NULL::{_DUCK_TYPES[types[c]]} AS {c}" for c in columns)
    return f"{create} {name} AS {flagged(f'SELECT {sel} FROM read_parquet([{files}], union_by_name = true)')}"


# The shards a build let into each view, with what it verified of them (path relative to the
# atlas's folder, size, mtime, sha256): a connection trusts a shard unchanged since (same size and
# mtime) and verifies any other against its checksum again, so no changed or vanished shard
# reaches a query between two builds.
SHARD_FILES_DDL = "CREATE TABLE shard_files (view VARCHAR, path VARCHAR, bytes BIGINT, mtime_ns BIGINT, sha256 VARCHAR)"


def connect(db_path: str | os.PathLike, read_only: bool = True,
            settings: Mapping[str, str] | None = None) -> duckdb.DuckDBPyConnection:
    """Open the atlas from any working directory. The views store their shards' paths relative
    to the folder that holds the database's folder (``results/composition/...``), so that the
    folder can be moved; DuckDB resolves such a path against the working directory first, and
    only then against ``file_search_path``. So a read-only connection shadows each shard view
    with a temporary view of the same name whose paths are absolute, in the database's folder as
    it is now (renamed since the build, too): the views never read another atlas's shards, e.g.
    the project's own ``results/`` while the atlas opened is a copy elsewhere (derived views
    resolve to the temporary ones). It also leaves out any shard gone or changed since the
    build (``shard_files``), listing it in its temporary ``excluded_shards``, never opens
    a WAL or a file a read-write session changed, answers from the last good copy while the
    atlas is missing (``atlas_files.readable``), and spills to a private temporary folder, not
    beside the atlas (``atlas_files.private_folder``), removed when the connection is collected
    or the process exits. ``settings``: DuckDB settings for a read-only connection (e.g.
    ``memory_limit``)."""
    folder = Path(db_path).resolve().parent
    if not read_only:
        con = duckdb.connect(str(db_path), config={"storage_compatibility_version": STORAGE_VERSION})
    else:
        path, private, notes = readable(db_path)
        for note in notes:
            log.warning("%s", note)
        spill = private_folder("spill")
        config: dict[str, str | bool | int | float | list[str]] = {"temp_directory": str(spill), **(settings or {})}
        try:
            try:
                con = duckdb.connect(str(path), read_only=True, config=config)
            except duckdb.IOException as e:
                if "lock" not in str(e).lower() or private:
                    raise
                log.warning("%s is held open read-write by another process; reading a copy of it", path)
                path, private = private_copy(Path(path)), True
                con = duckdb.connect(str(path), read_only=True, config=config)
        except BaseException:
            shutil.rmtree(spill, ignore_errors=True)
            raise
        weakref.finalize(con, shutil.rmtree, spill, ignore_errors=True)  # also at exit
        if private:  # open now: the copy goes when the connection closes
            Path(path).unlink()
            Path(path).parent.rmdir()
    con.execute(f"SET file_search_path = '{str(folder.parent).replace(chr(39), chr(39) * 2)}'")
    if read_only:
        if con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'shard_files'").fetchall()[0][0]:
            _verified_shard_views(con, folder)
        else:  # an atlas built before shard_files
            _pin_shard_paths(con, folder)
    return con


@contextmanager
def query_connection(db_path: str | os.PathLike,
                     settings: Mapping[str, str] | None = None) -> Iterator[duckdb.DuckDBPyConnection]:
    """A read-only connection (``connect``) locked down for user queries (``query_guard``):
    closed, and its spill folder removed, on leaving, by an error or Ctrl-C too."""
    con = connect(db_path, settings=settings)
    spill = Path(con.execute("SELECT current_setting('temp_directory')").fetchall()[0][0])
    try:
        lock_down(con, Path(db_path).resolve().parent)
        yield con
    finally:
        con.close()
        if PRIVATE.match(spill.name):
            shutil.rmtree(spill, ignore_errors=True)


def _pin_shard_paths(con: duckdb.DuckDBPyConnection, folder: Path) -> None:
    """The temporary views of ``connect``: each shard view's SQL with ``'<folder as built>/``
    replaced by the folder's absolute path."""
    comment = con.execute("SELECT comment FROM duckdb_views() WHERE view_name = 'composition'").fetchone()
    built_as = m.group(1) if comment and comment[0] and (m := _BASE_COMMENT.search(comment[0])) else folder.name
    relative = "'" + built_as.replace("'", "''") + "/"
    absolute = "'" + (folder.as_posix() + "/").replace("'", "''")
    views = con.execute("SELECT view_name, sql FROM duckdb_views() WHERE schema_name = 'main' AND NOT internal").fetchall()
    for name, sql in views:
        if name in SHARD_VIEWS and relative in sql:
            con.execute(sql.replace(relative, absolute).replace(f"CREATE VIEW {name} ", f"CREATE TEMP VIEW {name} ", 1))


def _verified_shard_views(con: duckdb.DuckDBPyConnection, folder: Path) -> None:
    """The temporary views of ``connect`` from ``shard_files``: absolute paths in the folder as
    it is now, each shard unchanged since the build or verified again; the others left out."""
    rows = con.execute("SELECT view, path, bytes, mtime_ns FROM shard_files ORDER BY view, path").fetchall()
    kept: dict[str, list[Path]] = {v: [] for v in SHARD_VIEWS}
    dropped = []
    for view, rel, size, mtime in rows:
        p = folder / rel
        st = p.stat() if p.exists() else None
        err = None if st and (st.st_size, st.st_mtime_ns) == (size, mtime) else shard_error(p)
        if err is None:
            kept[view].append(p)
        else:
            log.warning("left out of the %s view: result shard %s changed since the atlas was built (%s)", view, p, err)
            dropped.append((view, str(p), f"since the atlas was built: {err}"))
    built = dict(con.execute("SELECT view_name, sql FROM duckdb_views() WHERE schema_name = 'main'").fetchall())
    for view, types in SHARD_VIEWS.items():
        # the columns the build found in no shard are NULL in its view's SQL: not the footers again
        sql = built.get(view, "")
        absent = {c for c in types if f" AS {c}," in sql or f" AS {c} " in sql}
        # and those added to the schema since the build (its SQL never names them): NULL too, not an error
        absent |= {c for c in types if sql and not re.search(rf"\b{re.escape(c)}\b", sql)}
        while True:
            try:
                con.execute(_parquet_view(view, kept[view], types, temp=True, present=set(types) - absent,
                                          latest="k.latest" in built.get(view, "")))  # as the build made it
                break
            except duckdb.IOException:
                # a shard gone since it was checked (a rerun remaking it): that view goes on without it,
                # the other views and the connection are not failed for it
                gone = [p for p in kept[view] if not p.exists()]
                if not gone:
                    raise
                for p in gone:
                    kept[view].remove(p)
                    log.warning("left out of the %s view: result shard %s vanished while the connection opened (a "
                                "rerun remaking it?)", view, p)
                    dropped.append((view, str(p), "vanished while the connection opened"))
    if dropped:
        con.execute("CREATE TEMP TABLE excluded_shards AS SELECT * FROM main.excluded_shards")
        con.executemany("INSERT INTO temp.excluded_shards VALUES (?, ?, ?)", dropped)


def build_atlas(db_path: str | os.PathLike, shards: dict[str, list[str | os.PathLike]],
                meta_paths: list[str | os.PathLike], prev_token_threshold: float = 0.4,
                induction_threshold: float = 0.4, fdr: float = 0.05,
                computed: Callable[[duckdb.DuckDBPyConnection], Mapping[str, pl.DataFrame]] | None = None) -> None:
    """(Re)build the atlas database: a view per entry of ``tables.SHARD_VIEWS`` over its shards
    (empty views for the ones with none), then the derived views. Every shard is checked to open
    first, naming any bad one. The thresholds say which heads count as previous-token heads and
    as induction heads in ``composition_vs_behaviour``; ``fdr`` is the q-value cut of ``discoveries``.
    ``computed``: a function of a connection to the database being built that computes tables in
    Python from the shard views (name -> frame: ``function_agreement`` and ``function_bootstrap``, from
    one bootstrap), stored with ``latest`` where they have a checkpoint. It runs in a thread of its
    own while the derived views are made, so it must read none of them."""
    unknown = set(shards) - set(SHARD_VIEWS)
    if unknown:
        raise ValueError(f"no view is defined for {sorted(unknown)}")
    root = Path(db_path).resolve().parent
    for note in set_aside_sessions(db_path):
        log.warning("%s", note)
    excluded = []
    models = models_frame(meta_paths)
    weights = {(m, c): w for m, c, w in models.select("model", "checkpoint", "weights_sha256").iter_rows() if w}
    for view, paths in shards.items():
        bad = bad_shards(paths)
        stale = stale_shards([p for p in paths if str(p) not in bad], weights)
        for path, error in (bad | stale).items():
            where = set_aside(path, root) if error != "missing" else None
            moved = f"; set aside as {where}" if where else ""
            log.warning("left out of the %s view: result shard %s %s (%s)%s; the next snakemake run remakes it", view,
                        path, "is stale" if path in stale else "is corrupt or truncated", error, moved)
            excluded.append({"view": view, "path": path, "error": error + moved})
    dropped = {e["path"] for e in excluded}
    files = []
    for view, paths in shards.items():
        for p in map(Path, paths):
            if str(p) not in dropped:
                st, rel = p.stat(), p.resolve().relative_to(root) if p.resolve().is_relative_to(root) else p.resolve()
                files.append((view, rel.as_posix(), st.st_size, st.st_mtime_ns, checksum_path(p).read_text().split()[0]))
    with atomic_path(db_path) as tmp:
        tmp.unlink()  # duckdb wants to create the file itself
        con = connect(tmp, read_only=False)  # tmp sits beside db_path: the views bind relative to root
        try:
            con.execute("SET enable_progress_bar = false")  # its bars would fill the rule's log
            con.register("models_df", models.to_arrow())
            con.execute("CREATE TABLE models AS SELECT * FROM models_df")
            con.register("excluded_df", pl.DataFrame(excluded, schema=EXCLUDED_SHARDS_SCHEMA).to_arrow())
            con.execute("CREATE TABLE excluded_shards AS SELECT * FROM excluded_df")
            con.execute(SHARD_FILES_DDL)
            if files:
                con.executemany("INSERT INTO shard_files VALUES (?, ?, ?, ?, ?)", files)
            create_derived_view(con, "checkpoints", fdr, prev_token_threshold, induction_threshold)  # the shard views join it
            for name, types in SHARD_VIEWS.items():
                kept = [p for p in shards.get(name, []) if str(p) not in dropped]
                con.execute(_parquet_view(name, kept, types, root))
                hint = SEARCH_PATH_HINT.format(parent=root.parent)
                comment = (f"shard paths are relative to the folder holding '{root.name}/' (the project folder "
                           f"by default); from elsewhere first run: {hint}")
                con.execute(f"COMMENT ON VIEW {name} IS '{comment.replace(chr(39), chr(39) * 2)}'")
            # computed reads the shard views only: in a thread, on a connection of its own, while the derived views
            # are made (DuckDB stores composition_vs_function on one core)
            reader = con.cursor()  # with none of the connection's session settings: its own
            reader.execute(f"SET file_search_path = '{str(root.parent).replace(chr(39), chr(39) * 2)}'")
            reader.execute("SET enable_progress_bar = false")
            try:
                with ThreadPoolExecutor(1) as ahead:
                    frames = ahead.submit(computed or (lambda _: {}), reader)
                    for view in DERIVED_VIEWS[1:]:
                        create_derived_view(con, view, fdr, prev_token_threshold, induction_threshold)
                    tables = frames.result()
            finally:
                reader.close()
            for name, frame in tables.items():
                con.register(f"{name}_df", frame.to_arrow())
                select = f"SELECT * FROM {name}_df"
                con.execute(f"CREATE TABLE {name} AS {with_latest(select) if needs_latest(frame.columns) else select}")
                con.unregister(f"{name}_df")
        finally:
            con.close()
        with atomic_path(last_good_path(db_path)) as keep:  # what queries fall back on (see last_good_path)
            shutil.copyfile(tmp, keep)
            seal(keep, last_good_path(db_path))
        seal(tmp, db_path)  # a read-write session's checkpointed change then shows (atlas_files.as_built)


def query(db_path: str | os.PathLike, sql: str | bytes, settings: Mapping[str, str] | None = None) -> pl.DataFrame:
    """The answer to ``sql``, read statements only, on a connection that reads nothing outside
    the atlas's folder and writes nothing (``query_guard``), not even its spills."""
    sql = sql_text(sql)
    check_read_only(sql)
    with query_connection(db_path, settings) as con:
        return con.sql(sql).pl()
