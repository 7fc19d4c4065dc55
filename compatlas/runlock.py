"""One run at a time on a results folder: a lock file under ``results/``.

Snakemake locks its working directory (``.snakemake/``), not the results folder, so two runs
started from different folders on one shared ``results/`` would both compute every job. The
Snakefile takes this lock when a run starts (not for dry runs, nor inside jobs) and gives it back
when the run ends. The lock file names its holder (host, pid, working directory, start time) and
is touched every ``HEARTBEAT_S`` seconds while the run lives. A lock is stale, and is taken over
with a warning, when its holder was on this host and its process is gone, or when it has not
been touched for ``stale_s`` seconds (a holder on another node that died; default 300 s,
``COMPATLAS_LOCK_STALE_S``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

LOCK_NAME = ".compatlas-run.lock"
HEARTBEAT_S = 30.0

log = logging.getLogger(__name__)


class RunLockError(RuntimeError):
    """Another live run holds the results folder; the message says which, in one line."""


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

    def release(self) -> None:
        self._stop.set()
        try:
            if json.loads(self.path.read_text()).get("token") == self.token:
                self.path.unlink()
        except (OSError, ValueError):
            pass


def acquire(results: str | os.PathLike, workdir: str | os.PathLike, stale_s: float | None = None,
            heartbeat_s: float = HEARTBEAT_S) -> RunLock:
    """Take the results folder's lock, or raise RunLockError naming the run that holds it."""
    stale_s = float(os.environ.get("COMPATLAS_LOCK_STALE_S", "300")) if stale_s is None else stale_s
    results = Path(workdir, results).resolve()
    results.mkdir(parents=True, exist_ok=True)
    path = results / LOCK_NAME
    token = f"{socket.gethostname()}:{os.getpid()}:{time.time()}"
    me = {"host": socket.gethostname(), "pid": os.getpid(), "workdir": str(Path(workdir).resolve()),
          "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "token": token}
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)  # atomic, NFS included
        except FileExistsError:
            try:
                holder = json.loads(path.read_text())
                age = time.time() - path.stat().st_mtime
            except FileNotFoundError:
                continue  # released meanwhile
            except ValueError:  # being written this instant, or garbage left by a crash
                holder, age = {}, time.time() - path.stat().st_mtime
                if age < 5:
                    time.sleep(1)
                    continue
            reason = stale_reason(holder, age, stale_s)
            if reason is None:
                raise RunLockError(
                    f"{results} is in use by another run (from {holder.get('workdir')} on {holder.get('host')}, "
                    f"pid {holder.get('pid')}, since {holder.get('started')}): wait for it to finish, or, if that "
                    f"run is gone, delete {path}") from None  # the lock file's existence is the message
            log.warning("taking over the lock of %s: %s (held by %s)", results, reason, holder)
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        lock = RunLock(path, token, heartbeat_s)
        threading.Thread(target=lock._beat, daemon=True, name="compatlas-run-lock").start()
        return lock
    raise RunLockError(f"could not take the lock {path}: it keeps changing hands")
