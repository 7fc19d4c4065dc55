"""The atlas file itself, and what a user's read-write session can leave on it.

``duckdb.connect(path)`` opens read-write by default. Such a session's writes land either in
the file (checkpointed at a clean close) or in ``<atlas>.wal`` beside it, a file DuckDB finds
by name and replays into whatever database then sits at that path: a rebuilt atlas would
inherit a crashed session's ``DELETE`` and ``DROP VIEW``. So:

- every build writes the atlas's sha256 beside it (``storage.seal``), and its last-good copy's;
- a rebuild first moves any WAL beside the atlas or its copy to ``results/atlas-sessions/``,
  with a copy of the database it belongs to, and says so (``set_aside_sessions``);
- a compatlas connection (``atlas.connect``) never opens a WAL or a changed file: with a WAL
  beside the atlas (or a read-write holder's lock on it) it opens a private copy of the file
  as built; an atlas whose bytes no longer match its checksum, or no atlas at all (a rebuild
  running or failed), is replaced by the last-good copy, with a warning (``readable``).

A query writes nothing under ``results/`` either: what DuckDB spills to disk (a sort or a join
larger than its memory; by default into ``atlas.duckdb.tmp/`` beside the file) goes to a private
folder in the system's temporary folder (``private_folder``), removed when the connection goes,
and the folders of killed queries by the next one (``remove_leftovers``).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from compatlas.storage import checksum_path, file_sha256

SESSIONS = "atlas-sessions"  # under results/: what read-write sessions left on the atlas, kept
# The temporary folders a connection makes, named compatlas-<what>-<pid>-<random> so that the next
# connection knows which ones a killed process left (its pid is gone).
PRIVATE = re.compile(r"compatlas-(spill|atlas)-(\d+)-")
CHANGED = ("changed since it was built (its bytes no longer match the sha256 its build wrote; a read-write session, "
           "a copy or an edit over it, or a disk error)")


class AtlasChanged(RuntimeError):
    """The atlas was changed since it was built and no good copy is left; one line."""


def last_good_path(db_path: str | os.PathLike) -> Path:
    """A copy of the last atlas that was built whole, beside it (so its relative shard paths hold).
    Snakemake removes a job's outputs before it runs and after it fails, so while a rebuild runs
    or after it failed there is no ``atlas.duckdb``; ``compatlas query`` then answers from this."""
    p = Path(db_path)
    return p.with_name(f".{p.stem}.last-good{p.suffix}")


def wal_path(db_path: str | os.PathLike) -> Path:
    return Path(f"{db_path}.wal")


def as_built(db_path: str | os.PathLike) -> bool | None:
    """Whether the file's bytes are the ones its build sealed (None: no checksum, an atlas built
    before atlases were sealed)."""
    side = checksum_path(db_path)
    if not side.is_file():
        return None
    return side.read_text().split()[:1] == [file_sha256(db_path)]


def set_aside_sessions(db_path: str | os.PathLike) -> list[str]:
    """Move the WAL a read-write session left beside the atlas or its last-good copy (and a copy
    of the database it belongs to, where one is left) to ``results/atlas-sessions/<UTC time>/``,
    so that the rebuilt atlas never replays it. Returns a line per file moved."""
    notes = []
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for db in (Path(db_path), last_good_path(db_path)):
        wal = wal_path(db)
        if not wal.exists():
            continue
        keep = db.parent / SESSIONS / stamp
        keep.mkdir(parents=True, exist_ok=True)
        if db.exists():
            shutil.copyfile(db, keep / db.name)
        os.replace(wal, keep / wal.name)
        notes.append(f"{wal} was left by a read-write session (its writes were never part of the atlas); moved to "
                     f"{keep}/ with the database it belongs to, and not replayed into the rebuilt atlas")
    return notes


def readable(db_path: str | os.PathLike) -> tuple[Path, bool, list[str]]:
    """Which file a read-only compatlas connection opens for ``db_path``: (path, whether it is a
    private copy to delete once open, warnings). No atlas (Snakemake removed it for a rebuild
    now running, or one that failed) and a changed one are answered from the last good copy."""
    db, good = Path(db_path), last_good_path(db_path)
    notes: list[str] = []
    if not db.exists():
        if db == good or not good.exists():
            raise FileNotFoundError(f"no atlas at {db.absolute()} (nor its last good copy); run the pipeline first")
        notes.append(f"no {db} (a rebuild running or failed); answering from the last good atlas {good}")
        db = good
        if as_built(db) is False:
            raise AtlasChanged(f"{db} was {CHANGED}; rerun snakemake to rebuild the atlas")
    elif (built := as_built(db)) is False:  # hashes the atlas: once per connection
        if db == good or not good.exists() or as_built(good) is False:
            raise AtlasChanged(f"{db} was {CHANGED} and no good copy is left; rerun snakemake to rebuild it")
        notes.append(f"{db} was {CHANGED}; answering from the last good atlas {good} (the next snakemake run "
                     "rebuilds it)")
        db = good
    elif built is None and db != good and good.exists() and as_built(good):
        # its seal is gone (deleted, or never written by a build killed between its two renames): what it
        # holds cannot be told from a session's edits, while the sealed last good copy can
        notes.append(f"{db} has no seal ({checksum_path(db).name}), so its bytes cannot be checked; answering from the "
                     f"last good atlas {good} (the next snakemake run rebuilds it)")
        db = good
    if wal_path(db).exists():
        notes.append(f"{wal_path(db)} was left by a read-write session; its writes are not read (the next snakemake "
                     f"run moves it to {db.parent / SESSIONS}/ and rebuilds the atlas)")
        return private_copy(db), True, notes
    return db, False, notes


def private_folder(what: str) -> Path:
    """A new folder of this process's own in the system's temporary folder (``what``: ``spill``
    or ``atlas``), after removing the ones killed processes left."""
    remove_leftovers()
    return Path(tempfile.mkdtemp(prefix=f"compatlas-{what}-{os.getpid()}-"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_leftovers(root: str | os.PathLike | None = None) -> list[Path]:
    """Remove the private folders (``private_folder``) of processes that no longer run, in
    ``root`` (the system's temporary folder by default); returns those removed. A folder whose
    pid a live process has taken since waits for that one to end."""
    removed = []
    folder = Path(root or tempfile.gettempdir())
    for p in folder.glob("compatlas-*-*-*"):
        m = PRIVATE.match(p.name)
        try:
            ours = p.is_dir() and p.stat().st_uid == os.getuid()
        except OSError:  # removed meanwhile, by another query doing the same
            continue
        if m and ours and not _alive(int(m.group(2))):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def private_copy(db: Path) -> Path:
    """The atlas copied to a temporary folder, without any WAL or lock of the original."""
    copy = private_folder("atlas") / db.name
    shutil.copyfile(db, copy)
    return copy
