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
  as built; an atlas whose bytes no longer match its checksum is replaced by the last-good copy,
  with a warning (``readable``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from compatlas.storage import checksum_path, file_sha256

SESSIONS = "atlas-sessions"  # under results/: what read-write sessions left on the atlas, kept


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
    private copy to delete once open, warnings)."""
    db = Path(db_path)
    notes: list[str] = []
    if as_built(db) is False:
        good = last_good_path(db)
        if db == good or not good.exists() or as_built(good) is False:
            raise AtlasChanged(f"{db} was changed since it was built (a read-write session) and no good copy is "
                               "left; rerun snakemake to rebuild it")
        notes.append(f"{db} was changed since it was built (a read-write session); answering from the last good "
                     f"atlas {good} (the next snakemake run rebuilds it)")
        db = good
    if wal_path(db).exists():
        notes.append(f"{wal_path(db)} was left by a read-write session; its writes are not read (the next snakemake "
                     f"run moves it to {db.parent / SESSIONS}/ and rebuilds the atlas)")
        return private_copy(db), True, notes
    return db, False, notes


def private_copy(db: Path) -> Path:
    """The atlas copied to a temporary folder, without any WAL or lock of the original."""
    copy = Path(tempfile.mkdtemp(prefix="compatlas-atlas-")) / db.name
    shutil.copyfile(db, copy)
    return copy
