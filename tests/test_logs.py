"""A job's log: what it writes reaches the rule's log file, also when the job leaves through
``exit_now`` (no interpreter teardown), and the job still exits 0; a job's start-up is timed from
its process's start."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest


def test_exit_now_flushes_the_log_and_exits_zero(tmp_path):
    log = tmp_path / "logs" / "job.log"
    code = (f"from compatlas.logs import setup, exit_now\n"
            f"log = setup({str(log)!r}, 1)\n"
            f"log.info('last line ' + 'x' * 20000)\n"  # more than one buffer's worth
            f"exit_now()\n"
            f"raise SystemExit('not reached')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "last line " + "x" * 20000 in log.read_text()
    assert "not reached" not in done.stderr


@pytest.mark.skipif(not Path("/proc/uptime").is_file(), reason="process start times come from Linux's /proc")
def test_a_process_start_is_when_it_was_spawned():
    """process_started lies between the moment before the process was spawned and the child's own
    first clock reading (within /proc's 10 ms ticks): the boot time in /proc/stat, whole seconds,
    had put every start up to a second early."""
    before = time.time()
    out = subprocess.run([sys.executable, "-c", "import time; t = time.time(); from compatlas.logs import process_started; "
                          "print(t, process_started())"], capture_output=True, text=True, check=True).stdout.split()
    first, started = float(out[0]), float(out[1])
    assert before - 0.02 <= started <= first + 0.02, (before, started, first)
