"""What ``compatlas query`` lets through: read statements only, on a connection that cannot
write, attach or install anything, nor read outside the atlas's folder.

Two locks, because either alone leaks. The statement types (DuckDB's own parser,
``duckdb.extract_statements``) refuse COPY, EXPORT, ATTACH, INSTALL / LOAD, DROP, SET, ... before
anything runs: a read-only database still lets COPY TO and EXPORT write files, ATTACH open
another atlas read-write, and DROP VIEW drop the session's own shadowing view (``atlas.connect``)
and say "Success". The connection's settings then hold for whatever a SELECT reaches: file
access only inside the atlas's folder (``allowed_directories``), no network, no extensions, and
the configuration locked so that no statement can undo it.

Every read DuckDB has parses as a SELECT (WITH, FROM-first, VALUES, TABLE, UNPIVOT, DESCRIBE,
SHOW, SUMMARIZE) or as an EXPLAIN of one, except a PIVOT whose values come from the data
(``PIVOT t ON col`` without ``IN (...)``): DuckDB parses it into a MULTI statement (a temporary
ENUM of the values, then the query), the same type an ALTER or a TRUNCATE of several tables
gets. So a MULTI is judged by the statement around its PIVOTs: each PIVOT is replaced by
``SELECT 1`` and the text parsed again (``CREATE TABLE x AS PIVOT ...`` stays a CREATE).
"""

from __future__ import annotations

import os
from pathlib import Path

import duckdb

READ_TYPES = {duckdb.StatementType.SELECT}
READS = "SELECT, WITH, FROM, VALUES, PIVOT, UNPIVOT, DESCRIBE, SHOW, SUMMARIZE, EXPLAIN of those"
_PIVOTS = {b"PIVOT", b"PIVOT_WIDER"}

Token = tuple[int, int, bytes, duckdb.token_type]  # start, end (bytes of the UTF-8 text), text, type


class RefusedStatement(ValueError):
    """A statement ``compatlas query`` does not run; the message is the one line it prints."""


def sql_text(sql: str | bytes) -> str:
    """``sql`` as text DuckDB takes: bytes must be UTF-8, and so must a str (a command-line
    argument in another encoding reaches Python as lone surrogates, which DuckDB's binding
    rejects with a TypeError listing its signatures)."""
    try:
        raw = sql if isinstance(sql, bytes) else sql.encode("utf-8", "surrogateescape")
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        where = f"byte 0x{e.object[e.start:e.start + 1].hex()} at offset {e.start}"
    except UnicodeEncodeError as e:  # a lone surrogate that no byte escapes
        where = f"character U+{ord(e.object[e.start]):04X} at offset {e.start}"
    raise RefusedStatement(f"the SQL is not UTF-8 text ({where}); save or pass it as UTF-8 "
                           "(e.g. iconv -f latin1 -t utf-8 query.sql)")


def _tokens(raw: bytes) -> list[Token]:
    """DuckDB's tokens of ``raw`` (its offsets are of the UTF-8 bytes), comments left out."""
    found = duckdb.tokenize(raw.decode("utf-8"))
    ends = [start for start, _ in found[1:]] + [len(raw)]
    return [(start, end, raw[start:end].strip(), kind) for (start, kind), end in zip(found, ends)
            if kind != duckdb.token_type.comment]


def _closing(tokens: list[Token], i: int) -> int:
    """The index of the token that closes the parenthesis ``tokens[i]`` opens (len when none)."""
    depth = 0
    for j in range(i, len(tokens)):
        depth += {b"(": 1, b")": -1}.get(tokens[j][2], 0)
        if depth == 0:
            return j
    return len(tokens)


def _explained(query: str) -> list[str]:
    """The statement an EXPLAIN explains, after ``ANALYZE`` or an option list (``(ANALYZE)``,
    ``(FORMAT json)``): the text after the parenthesis first, and when that does not parse, the
    parenthesis itself as the start of the statement (``EXPLAIN (SELECT 1) UNION SELECT 2``)."""
    raw = query.encode()
    tokens = _tokens(raw)
    i = 1 + (len(tokens) > 1 and tokens[1][2].upper() in (b"ANALYZE", b"ANALYSE"))
    if i >= len(tokens):
        return []
    whole = raw[tokens[i][0]:].decode()
    if tokens[i][2] != b"(" or (after := _closing(tokens, i) + 1) >= len(tokens):
        return [whole]
    return [raw[tokens[after][0]:].decode(), whole]


def _sql_standard(tokens: list[Token], i: int) -> bool:
    """Whether the PIVOT at ``tokens[i]`` is the SQL standard's (``FROM t PIVOT (sum(x) FOR col IN
    (...))``), which names its values and so leaves the statement a SELECT."""
    if i + 1 >= len(tokens) or tokens[i + 1][2] != b"(":
        return False
    depth = 0
    for _, _, text, kind in tokens[i + 1:_closing(tokens, i + 1)]:
        depth += {b"(": 1, b")": -1}.get(text, 0)
        if depth == 1 and kind == duckdb.token_type.keyword and text.upper() == b"FOR":
            return True
    return False


def _without_pivots(query: str) -> str:
    """``query`` with every PIVOT (from its keyword to the end of its parenthesis, or of the
    statement) replaced by ``SELECT 1``: what is left is the statement around the PIVOTs."""
    raw = query.encode()
    tokens = _tokens(raw)
    out, at, i = [], 0, 0
    while i < len(tokens):
        if tokens[i][3] != duckdb.token_type.keyword or tokens[i][2].upper() not in _PIVOTS or _sql_standard(tokens, i):
            i += 1
            continue
        out += [raw[at:tokens[i][0]], b"SELECT 1 "]
        depth, i = 0, i + 1
        while i < len(tokens) and tokens[i][2] != b";" and not (tokens[i][2] == b")" and depth == 0):
            depth += {b"(": 1, b")": -1}.get(tokens[i][2], 0)
            i += 1
        at = tokens[i][0] if i < len(tokens) else len(raw)
    return b"".join([*out, raw[at:]]).decode()


def _first_word(query: str) -> str:
    tokens = _tokens(query.encode())
    return tokens[0][2].decode().upper() if tokens else "empty"


def _refusal(stmt: duckdb.Statement) -> str | None:
    """What a statement that is not a read is (``COPY``, ``EXPLAIN of a COPY``), None for a read."""
    if stmt.type in READ_TYPES:
        return None
    if stmt.type == duckdb.StatementType.EXPLAIN:
        for inner in _explained(stmt.query):
            try:
                parsed = duckdb.extract_statements(inner)
            except duckdb.Error:
                continue
            refused = next((r for s in parsed if (r := _refusal(s))), None)
            return f"EXPLAIN of {_article(refused)} {refused}" if refused else None
        return "EXPLAIN"
    if stmt.type == duckdb.StatementType.MULTI:
        try:
            parsed = duckdb.extract_statements(_without_pivots(stmt.query))
        except duckdb.Error:
            parsed = []
        if len(parsed) == 1 and parsed[0].type != duckdb.StatementType.MULTI:
            return _refusal(parsed[0])
        if any(t[3] == duckdb.token_type.keyword and t[2].upper() in _PIVOTS for t in _tokens(stmt.query.encode())):
            raise RefusedStatement("cannot tell whether this PIVOT statement only reads; name the values it pivots "
                                   "on (PIVOT ... ON col IN ('a', 'b')) and it runs")
        return _first_word(stmt.query)  # e.g. an ALTER that DuckDB splits in several statements
    if stmt.type == duckdb.StatementType.LOAD:  # DuckDB types INSTALL a LOAD too: named by its own word
        words = [t[2].decode().upper() for t in _tokens(stmt.query.encode())[:2]]
        return "FORCE INSTALL" if words[:1] == ["FORCE"] else (words[0] if words else "LOAD")
    return stmt.type.name.replace("_", " ")


def _article(word: str) -> str:
    return "an" if word[:1] in "AEIOU" else "a"


def check_read_only(sql: str | bytes) -> None:
    """Raise ``RefusedStatement`` naming the first statement of ``sql`` that is not a read."""
    statements = duckdb.extract_statements(sql_text(sql))
    if not statements:
        raise RefusedStatement("no statement to run")
    for stmt in statements:
        if kind := _refusal(stmt):
            raise RefusedStatement(f"refused {_article(kind)} {kind} statement: compatlas query runs read statements "
                                   f"only ({READS}); the atlas is rebuilt by the pipeline, and your own tables "
                                   "belong in a database of your own")


def lock_down(con: duckdb.DuckDBPyConnection, folder: str | os.PathLike) -> None:
    """Limit ``con`` (after its views are set up) to reading files under ``folder``, the
    atlas's results folder: no other file, no network, no extension installed or loaded, and
    the configuration locked (its temp_directory too, which ``connect`` put outside ``folder``)."""
    allowed = Path(folder).resolve().as_posix().rstrip("/") + "/"
    con.execute(f"SET allowed_directories = ['{allowed.replace(chr(39), chr(39) * 2)}']")
    for setting in ("autoinstall_known_extensions", "autoload_known_extensions", "enable_external_access"):
        con.execute(f"SET {setting} = false")
    con.execute("SET lock_configuration = true")
