"""One run at a time on a results folder: a lock file under ``results/``.

Snakemake locks its working directory (``.snakemake/``), not the results folder, so two runs
started from different folders on one shared ``results/`` would both compute every job. The
Snakefile takes this lock when a run starts (not for dry runs, nor inside jobs) and gives it back
when the run ends. The lock file names its holder (host, pid, working directory, start time, a
token of its own) and is touched every ``HEARTBEAT_S`` seconds while the run lives. A lock is
stale, and is taken over with a warning, when its holder was on this host and its process is
gone, or when it has not been touched for ``stale_s`` seconds (a holder on another node that
died; default 300 s, ``COMPATLAS_LOCK_STALE_S``).

Atomic on a local and on a shared (NFS) filesystem:

- a lock is written whole under a private name, then linked to its name (``link(2)``, which fails
  where the name exists, on NFS too): nobody ever reads half a lock;
- a stale lock is taken over under an exclusive ``flock`` of a guard file beside it
  (``.compatlas-run.lock.guard``, never removed), where the taker reads the lock again and removes
  it only if it still holds the token it judged stale: of many takers at once exactly one wins
  (unlinking and creating in turn, two had both won in 10 of 30 trials). Linux's NFS client
  makes a ``flock`` an NFS lock that every node sees; on a filesystem without locks the stale
  lock is not taken over, and the error says to delete it.

The run's jobs carry its lock and token (``job_environ``, in the environment Snakemake's jobs
inherit): ``check_current``, called before every result is renamed into place, refuses a write by
a job whose run no longer holds the lock (a fork left behind by a killed run had sealed a shard
over the next run's, with exit 0 after).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from compatlas import worker

LOCK_NAME = ".compatlas-run.lock"
GUARD_SUFFIX = ".guard"
HEARTBEAT_S = 30.0
LOCK_ENV, TOKEN_ENV = "COMPATLAS_RUN_LOCK", "COMPATLAS_RUN_TOKEN"  # what a run's jobs inherit (job_environ)

log = logging.getLogger(__name__)
_in_process = threading.Lock()  # a flock over NFS is a POSIX lock, shared by a process's threads


class RunLockError(RuntimeError):
    """Another live run holds the results folder; the message says which, in one line."""


class SupersededJob(RuntimeError):
    """A job whose run no longer holds the results folder tried to write a result: refused."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def stale_reason(holder: dict, age_s: float, stale_s: float) -> str | None:
    """Why a lock's holder is gone, or None while it may be alive."""
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        return None if _alive(holder["pid"]) else f"its process {holder['pid']} on {holder['host']} is gone"
    if age_s > stale_s:
        return f"it was last touched {age_s:.0f} s ago (stale after {stale_s:.0f} s)"
    return None


@contextlib.contextmanager
def _guard(path: Path) -> Iterator[None]:
    """Exclusive hold of the lock's guard file, against every other taker and releaser."""
    with _in_process:
        fd = os.open(path.with_name(path.name + GUARD_SUFFIX), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the flock


def _read(path: Path) -> tuple[dict, float] | None:
    """The lock's holder and age, None when there is no lock; a lock that is not JSON (a crash
    of a version that wrote in place) reads as a holder that names nothing."""
    try:
        text, age = path.read_text(), time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(text)
    except ValueError:
        holder = {}
    return (holder if isinstance(holder, dict) else {}), age


@dataclass
class RunLock:
    path: Path
    token: str
    heartbeat_s: float = HEARTBEAT_S
    _stop: threading.Event = field(default_factory=threading.Event)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                os.utime(self.path)
            except OSError:
                return

    def job_environ(self) -> dict[str, str]:
        """What the run's jobs inherit, so that each write can be checked against the lock."""
        return {LOCK_ENV: str(self.path), TOKEN_ENV: self.token}

    def release(self) -> None:
        self._stop.set()
        try:
            with _guard(self.path):
                self._remove_if_mine()
        except OSError:  # no guard (a filesystem without locks): without it
            with contextlib.suppress(OSError):
                self._remove_if_mine()

    def _remove_if_mine(self) -> None:
        current = _read(self.path)
        if current is not None and current[0].get("token") == self.token:
            self.path.unlink()


def _create(path: Path, record: dict) -> bool:
    """Write ``record`` as the lock, whole, unless a lock exists: True when this call made it."""
    tmp = path.with_name(f"{path.name}.{record['token'].replace(':', '-')}.new")
    tmp.write_text(json.dumps(record))
    try:
        os.link(tmp, path)  # atomic, and fails where the name exists, NFS included
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def acquire(results: str | os.PathLike, workdir: str | os.PathLike, stale_s: float | None = None,
            heartbeat_s: float = HEARTBEAT_S) -> RunLock:
    """Take the results folder's lock, or raise RunLockError naming the run that holds it."""
    stale_s = float(os.environ.get("COMPATLAS_LOCK_STALE_S", "300")) if stale_s is None else stale_s
    results = Path(workdir, results).resolve()
    results.mkdir(parents=True, exist_ok=True)
    path = results / LOCK_NAME
    token = f"{socket.gethostname()}:{os.getpid()}:{time.time()}:{secrets.token_hex(4)}"
    me = {"host": socket.gethostname(), "pid": os.getpid(), "workdir": str(Path(workdir).resolve()),
          "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "token": token}
    for _ in range(5):
        if _create(path, me):
            lock = RunLock(path, token, heartbeat_s)
            threading.Thread(target=lock._beat, daemon=True, name="compatlas-run-lock").start()
            return lock
        current = _read(path)
        if current is None:
            continue  # released meanwhile
        holder, age = current
        reason = stale_reason(holder, age, stale_s)
        if reason is None:
            raise RunLockError(
                f"{results} is in use by another run (from {holder.get('workdir')} on {holder.get('host')}, "
                f"pid {holder.get('pid')}, since {holder.get('started')}): wait for it to finish, or, if that "
                f"run is gone, delete {path}")
        _take_over(path, holder, reason)
    raise RunLockError(f"could not take the lock {path}: it keeps changing hands")


def _take_over(path: Path, stale: dict, reason: str) -> None:
    """Remove the stale lock ``stale``, under the guard, if it is still the lock; the caller then
    creates its own (or finds the lock of the one taker that came first)."""
    try:
        with _guard(path):
            current = _read(path)
            if current is not None and current[0].get("token") == stale.get("token"):
                log.warning("taking over the lock of %s: %s (held by %s)", path.parent, reason, stale)
                path.unlink()
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise
        raise RunLockError(f"{path} is stale ({reason}), but this filesystem has no file locks to take it over "
                           f"safely ({e.strerror}): delete {path} and rerun") from None


def check_current(target: str | os.PathLike) -> None:
    """Raise SupersededJob unless this job's run still holds its results folder (``job_environ``)
    and, in a fork of the job server, the server is still its parent: called before ``target`` is
    renamed into place. A process without a run's environment (``--nolock``, a script run by hand,
    a test) is not checked."""
    if worker.left_behind():
        raise SupersededJob(f"refusing to write {target}: this job's server is gone (its run was stopped or killed); "
                            "its result is discarded")
    lock, token = os.environ.get(LOCK_ENV), os.environ.get(TOKEN_ENV)
    if not lock or not token:
        return
    try:
        current = _read(Path(lock))
    except OSError as e:
        raise SupersededJob(f"refusing to write {target}: cannot read the run's lock {lock} ({e.strerror})") from None
    if current is None or current[0].get("token") != token:
        now = "no run holds it" if current is None else f"run {current[0].get('pid')} on {current[0].get('host')} holds it"
        raise SupersededJob(f"refusing to write {target}: this job's run no longer holds {lock} ({now}); the job was "
                            "left behind by a run that ended or was killed, and its result is discarded")
