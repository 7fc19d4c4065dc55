"""The job server under faults (compatlas/worker/): a job's fork dies with its killed server and
writes nothing after; a silent client holds up no job and is dropped; malformed requests neither
kill nor hold up the server, each refused in one line of its log; a request from outside the run
(no secret, or a process that does not descend from the run's Snakemake) is refused and runs in
its own process; the start-up sweep follows no link and leaves other users' folders alone.

Real processes throughout: the server, the jobs, and the clients are each their own process;
every wait is bounded, scaled by the machine's load (``conftest.machine_slowdown``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from conftest import machine_slowdown
from test_worker import alive, job, ready, run

from compatlas import worker
from compatlas.worker import HEADER

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the job server forks: POSIX only")


def wait_for(check, seconds: float, what: str) -> None:
    """Poll ``check`` until true, failing after ``seconds`` times the machine's slowdown."""
    deadline = time.monotonic() + seconds * machine_slowdown()
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def refusals(log: Path) -> list[str]:
    return [ln for ln in log.read_text().splitlines() if ln.startswith("refused a request")]


# ----------------------------------------------------------------------------- a killed server


def test_a_job_dies_with_its_killed_server_and_writes_nothing_after(server, tmp_path):
    """kill -9 of the server while a job ran had left its fork running (reparented to init): it
    wrote and sealed its shard two minutes after Snakemake had failed the job."""
    ready(tmp_path / "worker.log")
    marker, late = tmp_path / "child.pid", tmp_path / "late.txt"
    script = job(tmp_path, textwrap.dedent(f"""
        import time
        open({str(marker)!r}, "w").write(str(os.getpid()))
        time.sleep(3)
        open({str(late)!r}, "w").write("written after the server died")
        """))
    proc = subprocess.Popen([sys.executable, str(script)], env={**os.environ, **server.environ},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: marker.exists() and marker.read_text(), 60, "the job never started")
        child, started = int(marker.read_text()), time.monotonic()
        assert child != proc.pid  # the job runs in the server's fork
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(30)
        _, err = proc.communicate(timeout=30 * machine_slowdown())
        assert proc.returncode != 0 and "went away before the job ended" in err  # Snakemake sees the job fail
        wait_for(lambda: not alive(child), 10, "the job's fork outlived its killed server")
        time.sleep(max(0.0, started + 4 - time.monotonic()))  # past the moment it would have written
        assert not late.exists()
    finally:
        proc.kill()
        proc.wait()


# ----------------------------------------------------------------------------- bad clients


def test_a_silent_client_holds_up_no_job_and_is_dropped(tmp_path):
    """A process that connected and sent nothing had stalled every job until it left."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "a.py").write_text("import json\nimport colorsys\n")
    log = tmp_path / "worker.log"
    timeout = 10 * machine_slowdown()
    w = worker.start(tmp_path, scripts, log, common=False, request_timeout_s=timeout)
    assert w is not None
    for name in w.environ:
        os.environ.pop(name)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        ready(log)
        silent.connect(w.socket_path)
        t0 = time.monotonic()
        proc = run(job(tmp_path), w.environ, tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["ppid"] == w.process.pid  # served, while the silent one holds on
        if time.monotonic() - t0 < timeout:  # still within its time: the server has not dropped it yet
            with pytest.raises(BlockingIOError):
                silent.recv(1, socket.MSG_DONTWAIT)
        silent.settimeout(timeout + 30 * machine_slowdown())
        assert silent.recv(1) == b""  # dropped once its time was up
        wait_for(lambda: refusals(log), 10, "no line in the log")
        assert len(refusals(log)) == 1 and "sent 0 bytes of its request" in refusals(log)[0], log.read_text()
        assert w.process.poll() is None
    finally:
        silent.close()
        w.stop()


def send(path: str, payload: bytes, fds: int = 3) -> bytes:
    """Send ``payload`` as a client would (with ``fds`` descriptors of /dev/null) and return the
    server's whole answer, up to its closing the connection (nothing, for a refused request)."""
    nulls = [os.open(os.devnull, os.O_RDWR) for _ in range(fds)]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(60 * machine_slowdown())
    try:
        conn.connect(path)
        socket.send_fds(conn, [payload], nulls) if nulls else conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := conn.recv(64):
            answer += chunk
        return answer
    except ConnectionResetError:  # closed with the rest of the request unread: refused too
        return b""
    finally:
        conn.close()
        for fd in nulls:
            os.close(fd)


def framed(body: object) -> bytes:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return HEADER.pack(len(raw)) + raw


def test_malformed_requests_neither_kill_nor_hold_up_the_server(server, tmp_path):
    """A request whose JSON was a list (5 bytes: ``[1,2]``) had killed the server with an
    AttributeError; the running job failed and its fork wrote on. Each is now one line of the log."""
    ready(tmp_path / "worker.log")
    good = {"argv": [str(tmp_path / "x.py")], "cwd": str(tmp_path), "env": {}, "path": [], "network": False,
            "secret": server.secret}
    bad = {
        "a list": (framed([1, 2]), 3, "is an array, not an object"),
        "a list, no descriptors": (framed([1, 2]), 0, "0 file descriptors"),
        "not JSON": (framed(b"{argv"), 3, "not JSON"),
        "a number": (framed(7), 3, "is a number, not an object"),
        "a field missing": (framed({k: v for k, v in good.items() if k != "env"}), 3, "fields are"),
        "a field of the wrong type": (framed({**good, "argv": "x.py"}), 3, "argv is a string, not an array"),
        "env not strings": (framed({**good, "env": {"A": 1}}), 3, "env must map strings to strings"),
        "another secret": (framed({**good, "secret": "0" * 32}), 3, "does not carry this run's secret"),
        "too large": (HEADER.pack(2**31) + b"{", 3, "more than"),
        "cut short": (HEADER.pack(100) + b'{"argv"', 3, "closed its connection after"),
        "five descriptors": (framed(good), 5, "more than 3 file descriptors"),
        "a line break in a field name": (framed({**good, "x\ny": 1}), 3, "fields are"),
    }
    for what, (payload, fds, line) in bad.items():
        before = len(refusals(tmp_path / "worker.log"))
        assert send(server.socket_path, payload, fds) == b"", what  # refused: no "S", the connection closed
        new = refusals(tmp_path / "worker.log")[before:]
        assert len(new) == 1 and line in new[0], (what, new)
        assert server.process.poll() is None, what
    assert len(refusals(tmp_path / "worker.log")) == len(bad)
    proc = run(job(tmp_path), server.environ, tmp_path)  # and the next job is served as before
    assert proc.returncode == 0 and json.loads(proc.stdout)["ppid"] == server.process.pid, proc.stderr


def test_a_request_from_outside_the_run_is_refused_and_runs_in_its_own_process(server, tmp_path):
    """Any process of the same user had been able to run any script in the server. Without the
    run's secret, or from a process that does not descend from the run's Snakemake (here: this test's
    process, which started the server), a job is refused and runs in its own process."""
    ready(tmp_path / "worker.log")
    log = tmp_path / "worker.log"
    no_secret = run(job(tmp_path), {worker.ENV: server.socket_path}, tmp_path)
    assert no_secret.returncode == 0 and json.loads(no_secret.stdout)["ppid"] != server.process.pid
    assert "does not carry this run's secret" in refusals(log)[-1]
    # an orphan (its parent gone, so reparented outside this process's tree) with the socket and the secret
    out = tmp_path / "orphan.json"
    script = tmp_path / "orphan.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, sys, time
        launcher, deadline = int(sys.argv[1]), time.monotonic() + 60
        while os.getppid() == launcher and time.monotonic() < deadline:  # until its parent has left
            time.sleep(0.01)
        from compatlas.worker import hand_off
        hand_off(None)
        open({str(out)!r} + ".tmp", "w").write(json.dumps({{"ppid": os.getppid(), "pid": os.getpid()}}))
        os.rename({str(out)!r} + ".tmp", {str(out)!r})
        """))
    launcher = ("import os, subprocess, sys; subprocess.Popen([sys.executable, sys.argv[1], str(os.getpid())], "
                "start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)")
    subprocess.run([sys.executable, "-c", launcher, str(script)], env={**os.environ, **server.environ}, check=True,
                   timeout=60 * machine_slowdown())
    wait_for(out.exists, 60, "the orphan never finished")
    assert json.loads(out.read_text())["ppid"] != server.process.pid  # ran in its own process
    assert "is not a process of this run" in refusals(log)[-1], log.read_text()
    assert len(refusals(log)) == 2 and all("\n" not in ln for ln in refusals(log))


# ----------------------------------------------------------------------------- the start-up sweep


def dead_socket(folder: Path) -> Path:
    """A socket bound and closed in ``folder``: what a SIGKILLed server leaves."""
    folder.mkdir(exist_ok=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(folder / "socket"))
    s.close()
    return folder / "socket"


def test_the_sweep_follows_no_link_and_removes_only_this_users_folders():
    """As another user, ``ln -s VICTIM /tmp/compatlas-worker-zzevil`` had made the next run's
    sweep delete ``VICTIM/socket``. The sweep runs on a temporary folder of its own here (a short
    path: a socket's may not exceed about 100 bytes)."""
    tmp = Path(tempfile.mkdtemp(prefix="cw-"))
    try:
        victim = dead_socket(tmp / "victim")
        (tmp / f"{worker.PREFIX}zzevil").symlink_to(tmp / "victim")
        mine = dead_socket(tmp / f"{worker.PREFIX}mine").parent
        crowded = dead_socket(tmp / f"{worker.PREFIX}crowded").parent
        (crowded / "notes.txt").write_text("not a server's")
        theirs = None
        if os.getuid() == 0:  # a folder of another user's can only be made as root
            theirs = dead_socket(tmp / f"{worker.PREFIX}theirs").parent
            for p in (theirs, theirs / "socket"):
                os.chown(p, 65534, 65534, follow_symlinks=False)
        worker._sweep(tmp)
        assert victim.exists() and (tmp / f"{worker.PREFIX}zzevil").is_symlink()
        assert not mine.exists()  # this user's dead server: swept
        assert (crowded / "socket").exists()  # holds what a server does not make: left alone
        assert theirs is None or (theirs / "socket").exists()
    finally:
        shutil.rmtree(tmp)
