"""What ``compatlas query`` lets through: read statements only, on a connection that cannot
write, attach or install anything, nor read outside the atlas's folder.

Two locks, because either alone leaks. The statement types (DuckDB's own parser,
``duckdb.extract_statements``) refuse COPY, EXPORT, ATTACH, INSTALL / LOAD, DROP, SET, ... before
anything runs: a read-only database still lets COPY TO and EXPORT write files, ATTACH open
another atlas read-write, and DROP VIEW drop the session's own shadowing view (``atlas.connect``)
and say "Success". The connection's settings then hold for whatever a SELECT reaches: file
access only inside the atlas's folder (``allowed_directories``), no network, no extensions, and
the configuration locked so that no statement can undo it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import duckdb

# SELECT covers WITH, FROM-first, VALUES, DESCRIBE, SHOW and SUMMARIZE; EXPLAIN only of one of those
READ_TYPES = {duckdb.StatementType.SELECT}
_EXPLAIN = re.compile(r"^\s*explain\s+(analyze\s+)?", re.IGNORECASE)


class RefusedStatement(ValueError):
    """A statement ``compatlas query`` does not run; the message is the one line it prints."""


def _kind(stmt) -> str:
    return stmt.type.name.replace("_", " ")


def check_read_only(sql: str) -> None:
    """Raise ``RefusedStatement`` naming the first statement of ``sql`` that is not a read."""
    statements = duckdb.extract_statements(sql)
    if not statements:
        raise RefusedStatement("no statement to run")
    for stmt in statements:
        if stmt.type in READ_TYPES:
            continue
        if stmt.type == duckdb.StatementType.EXPLAIN:
            inner = duckdb.extract_statements(_EXPLAIN.sub("", stmt.query, count=1))
            if inner and all(s.type in READ_TYPES for s in inner):
                continue
        raise RefusedStatement(f"refused a {_kind(stmt)} statement: compatlas query runs read statements only "
                               "(SELECT, WITH, FROM, DESCRIBE, SHOW, SUMMARIZE, EXPLAIN); the atlas is rebuilt "
                               "by the pipeline, and your own tables belong in a database of your own")


def lock_down(con: duckdb.DuckDBPyConnection, folder: str | os.PathLike) -> None:
    """Limit ``con`` (after its views are set up) to reading files under ``folder``, the
    atlas's results folder: no other file, no network, no extension installed or loaded, and
    the configuration locked."""
    allowed = Path(folder).resolve().as_posix().rstrip("/") + "/"
    con.execute(f"SET allowed_directories = ['{allowed.replace(chr(39), chr(39) * 2)}']")
    for setting in ("autoinstall_known_extensions", "autoload_known_extensions", "enable_external_access"):
        con.execute(f"SET {setting} = false")
    con.execute("SET lock_configuration = true")
