"""One run at a time on a results folder (compatlas/runlock.py), also from different folders."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import machine_slowdown, tiny_config

from compatlas import runlock

REPO = Path(__file__).resolve().parent.parent


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid  # reaped: no process has it (pids are not reused this fast)


def fake_holder(results: Path, **holder) -> Path:
    results.mkdir(parents=True, exist_ok=True)
    path = results / runlock.LOCK_NAME
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "workdir": "/elsewhere",
                                "started": "then", "token": "x", **holder}))
    return path


def test_second_run_is_refused_and_the_first_gives_back(tmp_path: Path):
    lock = runlock.acquire("results", tmp_path / "a")
    with pytest.raises(runlock.RunLockError) as e:
        runlock.acquire(tmp_path / "a" / "results", tmp_path / "b")
    assert "\n" not in str(e.value) and f"from {tmp_path / 'a'}" in str(e.value)
    lock.release()
    assert not (tmp_path / "a" / "results" / runlock.LOCK_NAME).exists()
    runlock.acquire(tmp_path / "a" / "results", tmp_path / "b").release()


def test_stale_locks_are_taken_over(tmp_path: Path, caplog):
    results = tmp_path / "results"
    fake_holder(results, pid=dead_pid())  # this host, process gone
    runlock.acquire(results, tmp_path).release()
    assert "is gone" in caplog.text
    path = fake_holder(results, host="another-node")  # another node, not touched for a while
    with pytest.raises(runlock.RunLockError):
        runlock.acquire(results, tmp_path, stale_s=60)
    old = time.time() - 120
    os.utime(path, (old, old))
    runlock.acquire(results, tmp_path, stale_s=60).release()
    assert "last touched" in caplog.text


def test_heartbeat_keeps_a_live_lock_fresh(tmp_path: Path):
    lock = runlock.acquire("results", tmp_path, heartbeat_s=0.1)
    old = time.time() - 1000
    os.utime(lock.path, (old, old))
    deadline = time.monotonic() + 10 * machine_slowdown()  # stops a hang; a busy machine gets longer
    while time.time() - lock.path.stat().st_mtime > 500 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert time.time() - lock.path.stat().st_mtime < 500
    lock.release()


def test_snakemake_run_on_a_results_folder_in_use_stops_before_any_job(tmp_path: Path):
    shared = tmp_path / "shared-results"
    cfg = tiny_config()
    cfg["results"] = str(shared)
    work = tmp_path / "b"
    work.mkdir()
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))
    target = f"{shared}/weights/tiny-gpt2/final/meta.json"
    cmd = [sys.executable, "-m", "snakemake", target, "-s", str(REPO / "Snakefile"), "--cores", "1",
           "--directory", str(work), "--configfile", str(work / "config.yaml")]
    lock = fake_holder(shared, workdir=str(tmp_path / "a"))  # a live run (this test's own process) from folder a
    limit = 300 * machine_slowdown()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if "is in use by another run" in ln]
    assert len(lines) == 1 and f"from {tmp_path / 'a'}" in lines[0], proc.stderr[-3000:]
    assert not (shared / "weights").exists()
    lock.unlink()
    # Snakemake's own lock of folder b was given back: the next run needs no --unlock, and ends with no lock left
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (shared / "weights" / "tiny-gpt2" / "final" / "meta.json").exists()
    assert not (shared / runlock.LOCK_NAME).exists()
