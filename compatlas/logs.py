"""Logging for pipeline scripts: one log file per rule (snakemake.log) plus stderr."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

STARTED_ENV = "COMPATLAS_JOB_STARTED"  # the job's process start (epoch seconds), where a worker runs it (compatlas.worker)


def process_started(pid: int | str = "self") -> float | None:
    """When a process started (epoch seconds), from /proc (None elsewhere): a job's start-up is
    the time from its process's start to its script's first log line. The process's age comes from
    /proc/uptime (10 ms ticks): the boot time in /proc/stat is whole seconds, which had added a
    constant fraction of a second (0.7 s on one machine) to every job's start-up."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def setup(log_path: str | None, threads: int | None = None) -> logging.Logger:
    """Log to ``log_path`` and stderr; with ``threads``, torch (if the script imported it) uses
    that many, the cores Snakemake gave the job, not every core of the machine."""
    if threads and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_path:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_path, mode="w"))
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.captureWarnings(True)

    def log_uncaught(exc_type, exc, tb):
        # the error message belongs in the rule's log, where Snakemake points the user
        logging.getLogger("compatlas").error("%s: %s", exc_type.__name__, exc, exc_info=(exc_type, exc, tb))

    sys.excepthook = log_uncaught
    for noisy in ("transformers", "urllib3", "huggingface_hub", "filelock"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    log = logging.getLogger("compatlas")
    started = float(os.environ[STARTED_ENV]) if os.environ.get(STARTED_ENV) else process_started()
    if started is not None:  # benchmarks/bench_default_run.py reads it: start-up against work, per rule
        log.info("job start-up %.2fs (interpreter, imports)%s", time.time() - started,
                 " in the run's job server" if os.environ.get(STARTED_ENV) else "")
    return log


def log_peak_memory() -> None:
    """Log the job's peak resident memory so far (a fork of the job server counts the server's
    pages it shares, as the kernel does): benchmarks/bench_default_run.py reads it per rule."""
    import resource

    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux
    logging.getLogger("compatlas").info("peak resident memory %.0f MB", peak_kb / 1024)


def exit_now() -> None:
    """End a job whose outputs are written: flush the logs, then leave without the interpreter's
    teardown. With torch loaded, tearing down every module (and torch's C++ state) takes about
    0.4 s of a 2 s job, a minute of CPU over the default run's jobs (benchmarks/README.md,
    "Job start-up and teardown"). Outputs are already on disk: they are written atomically.
    Its last log line is the job's peak memory (``log_peak_memory``)."""
    log_peak_memory()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
