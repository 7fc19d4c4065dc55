"""A job in the job server's fork (``compatlas.worker``'s docstring): it dies with the server
(``die_with``: ``PR_SET_PDEATHSIG``, Linux) and runs the job's script from the top with the job's
streams, directory, environment and arguments (``run_child``)."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

from compatlas import worker

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _load_prctl() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: worker.left_behind refuses a left-behind job's writes
        return None


_PRCTL = _load_prctl()


def die_with(server: int) -> None:
    """In a forked child: be killed when the server (its parent) dies, and leave at once if it
    already has (it died between the fork and the prctl)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != server:
        os._exit(1)


def run_child(request: dict[str, Any], fds: list[int], keep: socket.socket, server: int) -> None:
    """The forked job: the streams, directory, environment and arguments of the job's process,
    then its script from the top (``worker.hand_off`` now returns there). Never returns."""
    worker._IN_CHILD = True  # the script's hand_off now returns
    worker._SERVER_PID = server  # its writes are refused once the server is gone (worker.left_behind)
    code = 1
    try:
        keep.close()
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.stdin, sys.stdout, sys.stderr = (open(i, mode, closefd=False, buffering=b)
                                             for i, mode, b in ((0, "r", -1), (1, "w", 1), (2, "w", 1)))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # the threads Snakemake gives the job (its OMP_NUM_THREADS): the server's torch read its own at import
        if "torch" in sys.modules and (threads := request["env"].get("OMP_NUM_THREADS", "")).isdigit():
            sys.modules["torch"].set_num_threads(int(threads))
        sys.argv = list(request["argv"])
        sys.path[:] = list(request["path"])
        script = Path(sys.argv[0])
        globs = {"__name__": "__main__", "__file__": str(script), "__builtins__": __builtins__}
        exec(compile(script.read_text(), str(script), "exec"), globs)  # Snakemake's script, its preamble included
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 (the job's error, reported as its own process would)
        exc_type, exc, tb = sys.exc_info()
        if exc_type is not None and exc is not None and sys.excepthook is not sys.__excepthook__:
            sys.excepthook(exc_type, exc, tb)  # compatlas.logs: into the rule's log and stderr
        else:
            traceback.print_exc()
    finally:
        try:
            import logging

            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
