"""A job's log: what it writes reaches the rule's log file, also when the job leaves through
``exit_now`` (no interpreter teardown), and the job still exits 0."""

from __future__ import annotations

import subprocess
import sys


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
