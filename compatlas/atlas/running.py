"""Running one ``compatlas query``: stopped at once by its time limit or by Ctrl-C, its rows
fetched only as far as they are shown, and written as CSV or JSON a batch at a time.

The query runs in a worker thread while the calling (main) thread waits, so that Python's
SIGINT handler, which only ever runs in the main thread, runs at once: DuckDB's client holds
the main thread while it executes or fetches, and a Ctrl-C would wait for it. The handler and
the time limit's timer both stop the query with ``con.interrupt()``.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import duckdb
import polars as pl

T = TypeVar("T")

TIMED_OUT = 124  # the exit status of a query stopped by --timeout, as timeout(1) gives
INTERRUPTED = 130  # the exit status of a query stopped by Ctrl-C: 128 + SIGINT, as a shell reports it
BATCH = 65536  # rows per batch written as CSV or JSON


class Stopped(RuntimeError):
    """A query stopped by its time limit or by Ctrl-C: the message is one line, ``code`` the
    exit status."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def interruptible(con: duckdb.DuckDBPyConnection, work: Callable[[threading.Event], T],
                  timeout: float | None = None) -> T:
    """``work(stopping)`` (which runs statements on ``con``), stopped by ``con.interrupt()`` after
    ``timeout`` seconds or at Ctrl-C, raising ``Stopped``; any error of its own is raised as it
    is. ``stopping`` is set then too, for a loop over batches between two of DuckDB's calls."""
    why: list[Stopped] = []
    done: dict[str, Any] = {}
    stopping = threading.Event()

    def stop(reason: Stopped) -> None:
        if not why:
            why.append(reason)
        stopping.set()
        con.interrupt()

    def run() -> None:
        try:
            done["value"] = work(stopping)
        except BaseException as e:  # noqa: BLE001 -- handed to the waiting thread, which raises it
            done["error"] = e

    worker = threading.Thread(target=run, name="compatlas-query", daemon=True)
    timer = None
    if timeout is not None:
        timer = threading.Timer(timeout, stop, (Stopped(f"query stopped by its time limit of {timeout:g} s (--timeout)",
                                                        TIMED_OUT),))
        timer.daemon = True
    previous = _on_sigint(lambda *_: stop(Stopped("query stopped by Ctrl-C", INTERRUPTED)))
    try:
        worker.start()
        if timer is not None:
            timer.start()
        while worker.is_alive():
            worker.join(0.05)  # short waits: the SIGINT handler runs between two of them
    finally:
        if timer is not None:
            timer.cancel()
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if "error" in done:
        if why:  # DuckDB's InterruptException, or a loop that saw ``stopping``
            raise why[0] from None
        raise done["error"]
    return done["value"]


def _on_sigint(handler: Callable[..., None]) -> Any:
    """Install ``handler`` for SIGINT, returning the one it replaces (None where signals cannot be
    handled: outside the main thread)."""
    try:
        return signal.signal(signal.SIGINT, handler)
    except ValueError:
        return None


def first_rows(con: duckdb.DuckDBPyConnection, sql: str, n: int) -> tuple[pl.DataFrame, bool]:
    """The first ``n`` rows of ``sql``'s answer and whether it has more. ``LIMIT n + 1`` is put
    around the query, so DuckDB stops there (or keeps the top n + 1 of an ORDER BY) instead of
    computing every row to drop all but a few."""
    rel = con.sql(sql)
    if rel is None:
        return pl.DataFrame(), False
    df = rel.limit(n + 1).pl()
    return df.head(n), df.height > n


def batches(con: duckdb.DuckDBPyConnection, sql: str, stopping: threading.Event,
            size: int = BATCH) -> Iterator[pl.DataFrame]:
    """Every row of ``sql``'s answer, ``size`` rows at a time from DuckDB's stream (never the whole
    answer in memory), until ``stopping`` is set; an empty answer gives one empty frame with its
    columns."""
    rel = con.sql(sql)
    if rel is None:
        return
    reader = rel.to_arrow_reader(size)
    names = unique_names(reader.schema.names)
    empty = True
    for batch in reader:
        if stopping.is_set():  # the rows DuckDB had made before it was interrupted are not wanted
            raise InterruptedError("stopped")
        empty = False
        yield pl.DataFrame(pl.from_arrow(batch.rename_columns(names)))
    if empty:
        yield pl.DataFrame(pl.from_arrow(reader.schema.empty_table().rename_columns(names)))


def unique_names(names: list[str]) -> list[str]:
    """Column names made unique as DuckDB makes them for a frame (``a``, ``a_1``): polars refuses
    two columns of one name, which SQL allows (``SELECT 1 AS a, 2 AS a``)."""
    seen: set[str] = set()
    out = []
    for name in names:
        new, k = name, 0
        while new in seen:
            k += 1
            new = f"{name}_{k}"
        seen.add(new)
        out.append(new)
    return out


def _blob(v: bytes) -> str:
    """A BLOB as DuckDB prints it: printable ASCII as it is, any other byte as \\xNN."""
    return "".join(chr(b) if 32 <= b < 127 and b != 92 else f"\\x{b:02X}" for b in v)


def _json_text(v: Any) -> str:
    return json.dumps(v, default=lambda x: _blob(x) if isinstance(x, bytes) else str(x), ensure_ascii=False)


def printable(df: pl.DataFrame, fmt: str) -> pl.DataFrame:
    """``df`` with the columns its format cannot write as text as strings: for CSV, a list, array,
    struct or map column as its values' JSON (``[1, 2]``, ``{"x": 1}``); for CSV and JSON, a BLOB
    as DuckDB prints it, and for JSON a nested column holding BLOBs as its JSON (polars writes
    neither format with binary in it)."""
    out = []
    for name, dtype in df.schema.items():
        col = df.get_column(name)
        if dtype == pl.Binary:
            out.append(pl.Series(name, [None if v is None else _blob(v) for v in col.to_list()], pl.String))
        elif dtype.is_nested() and (fmt == "csv" or "Binary" in str(dtype)):
            out.append(pl.Series(name, [None if v is None else _json_text(v) for v in col.to_list()], pl.String))
        else:
            out.append(col)
    return pl.DataFrame(out)
