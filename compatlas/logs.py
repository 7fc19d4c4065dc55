"""Logging for pipeline scripts: one log file per rule (snakemake.log) plus stderr."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path


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
    return logging.getLogger("compatlas")


def exit_now() -> None:
    """End a job whose outputs are written: flush the logs, then leave without the interpreter's
    teardown. With torch loaded, tearing down every module (and torch's C++ state) takes about
    0.4 s of a 2 s job, a minute of CPU over the default run's jobs (benchmarks/README.md,
    "Job start-up and teardown"). Outputs are already on disk: they are written atomically."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
