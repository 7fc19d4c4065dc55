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


# ----------------------------------------------------------------------------- concurrent takeovers


def _take(results: Path, workdir: Path, start, done, answers) -> None:
    """One taker (its own process): wait for every other, try to take the lock, say how it went,
    and hold on (alive) until every taker has tried: a winner that left would be stale at once."""
    start.wait(120)
    try:
        runlock.acquire(results, workdir)
        answers.put(("won", ""))
    except runlock.RunLockError as e:
        answers.put(("lost", str(e)))
    done.wait(300)


def test_one_winner_among_100_concurrent_takeovers_of_a_stale_lock(tmp_path: Path, monkeypatch):
    """Taking over by unlinking the stale lock and creating one's own let a second taker unlink
    the first one's new lock: two winners in 10 of 30 trials of two takers. Each taker here takes
    0 to 49 ms to judge the holder (a slow filesystem, a busy machine): a taker that acts on what it
    read that long ago must not remove a lock taken meanwhile."""
    import multiprocessing as mp
    import queue

    judge = runlock.stale_reason
    monkeypatch.setattr(runlock, "stale_reason", lambda *a: time.sleep(0.001 * (os.getpid() % 50)) or judge(*a))
    ctx = mp.get_context("fork")
    n = 100
    results = tmp_path / "results"
    for trial in range(2):
        fake_holder(results, pid=dead_pid(), token=f"dead-{trial}")  # a run killed on this host
        start, done, answers = ctx.Barrier(n), ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_take, args=(results, tmp_path / f"w{i}", start, done, answers)) for i in range(n)]
        for p in procs:
            p.start()
        try:
            got = [answers.get(timeout=120 * machine_slowdown()) for _ in range(n)]
        except queue.Empty:
            pytest.fail("a taker hung")
        finally:
            done.set()
            for p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()
        winners = [msg for kind, msg in got if kind == "won"]
        assert len(winners) == 1, (trial, len(winners))
        assert all("\n" not in msg and ("in use by another run" in msg or "changing hands" in msg)
                   for kind, msg in got if kind == "lost")
        holder = json.loads((results / runlock.LOCK_NAME).read_text())
        assert holder["pid"] in {p.pid for p in procs}  # the winner's, whole
        assert not [p for p in results.iterdir() if p.name.endswith(".new")]  # no private copy left


# ----------------------------------------------------------------------------- a job left behind


WRITER = """
import os, sys, time
from pathlib import Path
go = Path(sys.argv[2])
deadline = time.monotonic() + 120
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.02)
from compatlas.storage import atomic_path
with atomic_path(sys.argv[1]) as tmp:
    tmp.write_text("written by the job left behind")
"""


def test_a_job_left_behind_by_its_run_writes_nothing(tmp_path: Path):
    """A fork of a killed run had sealed its 512-sequence shard over the rerun's 64-sequence one,
    with a matching seal: the next run exited 0 with the old config's numbers. A write is refused
    once the job's run no longer holds the lock, whoever holds it now."""
    results = tmp_path / "results"
    target = results / "edge_attribution" / "edges.parquet"
    env = {k: v for k, v in os.environ.items() if k not in (runlock.LOCK_ENV, runlock.TOKEN_ENV)}
    limit = 120 * machine_slowdown()
    for case in ("rerun", "released", "current"):
        first = runlock.acquire(results, tmp_path / "a")
        go = tmp_path / f"go-{case}"
        job = subprocess.Popen([sys.executable, "-c", WRITER, str(target), str(go)], env={**env, **first.job_environ()},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        target.unlink(missing_ok=True)
        if case != "current":
            first.release()  # the run failed (Snakemake saw the job's process go)
        if case == "rerun":  # ... and was run again at once, with another config
            rerun = runlock.acquire(results, tmp_path / "a")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("the rerun's")
        go.touch()
        _, err = job.communicate(timeout=limit)
        if case == "current":
            assert job.returncode == 0, err
            assert target.read_text() == "written by the job left behind"
            first.release()
            continue
        assert job.returncode != 0 and "SupersededJob: refusing to write" in err, err
        assert next(ln for ln in err.splitlines() if "SupersededJob: refusing to write" in ln).count(str(target)) == 1
        assert target.read_text() == "the rerun's" if case == "rerun" else not target.exists()
        assert not list(target.parent.glob(".*.tmp"))
        if case == "rerun":
            rerun.release()


def test_a_fork_whose_server_is_gone_writes_nothing(tmp_path: Path, monkeypatch):
    """Where PR_SET_PDEATHSIG is not there to kill it (not Linux), a fork left by its server writes nothing."""
    from compatlas import worker
    from compatlas.storage import atomic_path

    monkeypatch.setattr(worker, "_IN_CHILD", True)
    monkeypatch.setattr(worker, "_SERVER_PID", os.getppid())  # its server: this process's parent
    with atomic_path(tmp_path / "a.txt") as tmp:
        tmp.write_text("served")
    monkeypatch.setattr(worker, "_SERVER_PID", dead_pid())  # its server gone: reparented
    with pytest.raises(runlock.SupersededJob, match="this job's server is gone"), atomic_path(tmp_path / "b.txt") as tmp:
        tmp.write_text("left behind")
    assert (tmp_path / "a.txt").exists() and not (tmp_path / "b.txt").exists()
