"""A job's start-up paid once per run: a fork server for the pipeline's Python scripts.

Every job of the pipeline is a Snakemake ``script:``, a fresh interpreter that imports torch,
polars and compatlas before it does any work: about 2 s of a core on an idle 2-core machine, 4 s
under load, against jobs whose own work is often a tenth of a second (benchmarks/README.md, "Job
start-up"). For a local run the Snakefile starts one server (``start``): it imports what the
scripts import, once, and waits on a Unix socket. Each script's first statement is
``hand_off(snakemake)``: the job's process (its interpreter has only loaded Snakemake's
preamble) sends the server its script, working directory, environment and standard streams; the
server forks a child, which runs the script from the top with every module already imported, and
sends back its exit status, which the job's process exits with. To Snakemake nothing changed: the
job is a process that runs until its work is done, writes to the same streams and exits with the
same status.

What keeps it safe:

- the child is a fork of a server that has only imported modules, never run torch nor touched a
  GPU (a forked CUDA context is unusable: the server refuses to serve if one exists), so each job
  starts from the same clean state and one job's state never reaches another;
- a job whose process goes away (Snakemake cancelled it, or was killed) loses its child: the
  server sees the connection close and kills it; the server and its children stay in Snakemake's
  process group, so a signal to the group reaches them as it reached the jobs before;
- the server leaves when Snakemake's run ends (``stop``) or its process disappears, and a child
  dies with its server (``PR_SET_PDEATHSIG``; elsewhere ``left_behind`` refuses its writes): a
  server killed alone had left a fork that sealed its shard two minutes after the run had failed;
- the server serves its own run only: a request comes from a process of this user that descends
  from the run's Snakemake (the socket's peer credentials) and carries the run's secret (in the
  environment the jobs inherit); a request that is malformed, too large, or silent past
  ``REQUEST_TIMEOUT_S`` is refused in one line of the server's log, and the server goes on;
- anything that goes wrong before the child starts (no server, a refused connection, a server
  that died) makes ``hand_off`` return: the script then runs in its own process, as without one.

It is for local runs only: on a cluster each job runs on a node of its own, in its own allocation,
where a server outside it would escape its limits (the Snakefile starts none; ``hand_off`` finds
no ``COMPATLAS_WORKER`` and returns). ``COMPATLAS_WORKER=off`` turns it off for a local run.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

ENV = "COMPATLAS_WORKER"  # the server's socket path, in the environment Snakemake's jobs inherit
SECRET_ENV = "COMPATLAS_WORKER_SECRET"  # the run's secret, in the same environment: every request carries it
PREFIX = "compatlas-worker-"  # a server's private folder in the system's temporary space
_IN_CHILD = False  # set in a forked child: its own hand_off runs the script there
_SERVER_PID = 0  # in a forked child: the server that forked it
HEADER = struct.Struct("!I")  # a request: its length, then its JSON
REQUEST_TIMEOUT_S = 30.0  # a connection that has not sent its whole request by then is dropped


def left_behind() -> bool:
    """Whether this process is a forked job whose server is gone (where ``PR_SET_PDEATHSIG``
    did not take it down with the server): no run waits for its results any more."""
    return _IN_CHILD and os.getppid() != _SERVER_PID


# ----------------------------------------------------------------------------- the job's side


def hand_off(snakemake: Any = None, network: bool = False) -> None:
    """Run the calling script in the run's server and exit with its status; return at once where
    there is no server (a cluster job, ``COMPATLAS_WORKER=off``, a test calling the script) or the
    server could not start it, so the script goes on in this process. ``snakemake`` is the
    script's global (unused: it makes the call's purpose plain at the call site). ``network``:
    the job loads a model from the hub, which the server's Hugging Face libraries, imported
    offline, cannot: it runs in its own process."""
    path = os.environ.get(ENV, "")
    if _IN_CHILD or not path or path == "off":
        return
    from compatlas.logs import STARTED_ENV, process_started

    # the whole request is ready before connecting: the server drops one that is slow to come
    env = dict(os.environ) | {STARTED_ENV: str(process_started() or time.time())}
    request = {"argv": sys.argv, "cwd": os.getcwd(), "env": env, "path": sys.path, "network": network,
               "secret": os.environ.get(SECRET_ENV, "")}
    body = json.dumps(request).encode()
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        socket.send_fds(conn, [HEADER.pack(len(body)) + body], [0, 1, 2])
        if conn.recv(1) != b"S":  # the server could not fork, or refused the request: run here
            conn.close()
            return
    except OSError:
        return
    # Snakemake cancels a job by signalling its process: leaving closes the connection, and the
    # server kills the child
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: os._exit(1))
    status = b""
    while len(status) < 4:
        chunk = conn.recv(4 - len(status))
        if not chunk:
            print(f"compatlas: the job's worker process ({path}) went away before the job ended", file=sys.stderr)
            os._exit(1)
        status += chunk
    os._exit(struct.unpack("!i", status)[0])


def run_fresh() -> NoReturn:
    """In a job's fork of the server: become a fresh interpreter that runs the job's script as its
    own process would (``COMPATLAS_WORKER=off``: its ``hand_off`` returns), for a job that needs
    what the server's imports may have settled (training's pinned kernels, which torch reads once).
    ``exec`` keeps the pid, the streams and the death signal, so the server and the job's process
    see it end as before. Outside a fork the script already runs in its own process: an error."""
    if not _IN_CHILD:
        raise RuntimeError("run_fresh is for a job running in the job server's fork")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, ENV: "off"})


# ----------------------------------------------------------------------------- the Snakefile's side


def _sweep(tmp: Path) -> None:
    """Remove the folders of this user's servers killed without a chance to clean up (SIGKILL): a
    socket no server listens on, or a folder without one that is an hour old. Only real folders
    this user owns, holding nothing but a socket of this user's: a link (another user's
    ``compatlas-worker-x -> /their/target``) is never followed, and the socket is removed through
    the folder as opened (no link followed) and checked, not through its name."""
    try:
        names = [n for n in os.listdir(tmp) if n.startswith(PREFIX)]
        tmp_fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        for name in names:
            with contextlib.suppress(OSError):  # another user's, or gone meanwhile
                _sweep_one(tmp, tmp_fd, name)
    finally:
        os.close(tmp_fd)


def _sweep_one(tmp: Path, tmp_fd: int, name: str) -> None:
    me = os.getuid()
    st = os.stat(name, dir_fd=tmp_fd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != me:
        return  # a link, a file, or another user's folder
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=tmp_fd)
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino) or set(os.listdir(fd)) - {"socket"}:
            return  # replaced meanwhile, or holds what a server does not make
        try:
            sock = os.stat("socket", dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            if time.time() - st.st_mtime < 3600:
                return  # a server starting up
        else:
            if not stat.S_ISSOCK(sock.st_mode) or sock.st_uid != me:
                return
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(tmp / name / "socket"))
                return  # a live server (another run's)
            except ConnectionRefusedError:
                pass
            finally:
                probe.close()
            os.unlink("socket", dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=tmp_fd)  # rmdir follows no link


def remove(socket_path: str) -> None:
    """The socket and its private folder (``start`` made it for this server alone)."""
    Path(socket_path).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(socket_path))


@dataclass
class Worker:
    """A running server, as ``start`` returns it to the Snakefile."""

    process: subprocess.Popen[bytes]
    socket_path: str
    secret: str

    @property
    def environ(self) -> dict[str, str]:
        """What a job needs in its environment to be served (``start`` sets it in this process's)."""
        return {ENV: self.socket_path, SECRET_ENV: self.secret}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        remove(self.socket_path)


# numpy's BLAS reads its threads once, when the server imports it, and every job forked from the
# server keeps them: one, as every job of the run has one core (with one per core on a busy
# 2-core machine, the atlas's bootstrap of partial correlations took 51 s against 6 s on one
# thread: its threads spun against the other work). A user's own setting is kept.
ONE_BLAS_THREAD = {"OPENBLAS_NUM_THREADS": "1"}


def start(run_dir: str | os.PathLike[str], scripts_dir: str | os.PathLike[str], log: str | os.PathLike[str],
          common: bool = True, request_timeout_s: float = REQUEST_TIMEOUT_S) -> Worker | None:
    """Start the run's server (``COMPATLAS_WORKER`` and the run's secret set in this process's
    environment, which the jobs inherit), logging to ``log``, importing what ``scripts_dir``'s
    scripts import (and, with ``common``, torch and transformers); None where
    ``COMPATLAS_WORKER=off`` or no Unix socket fits. The socket lives in a private folder of the
    system's temporary space: a socket path may not exceed about 100 bytes, which a results
    folder's often does. The secret reaches the server in its environment, never its arguments,
    which other users can read."""
    if os.environ.get(ENV) == "off" or not hasattr(os, "fork"):
        return None
    import tempfile

    _sweep(Path(tempfile.gettempdir()))
    folder = tempfile.mkdtemp(prefix=PREFIX)
    path = os.path.join(folder, "socket")
    secret = secrets.token_hex(16)
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "compatlas.worker.server", path, str(os.getpid()), str(scripts_dir),
                                    str(int(common)), str(request_timeout_s)],
                                   stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                   cwd=os.fspath(run_dir), env=ONE_BLAS_THREAD | os.environ | {SECRET_ENV: secret})
    for _ in range(200):  # the socket is bound before the first import: a fraction of a second
        if os.path.exists(path) or process.poll() is not None:
            break
        time.sleep(0.01)
    if not os.path.exists(path):
        process.kill()
        remove(path)
        return None
    w = Worker(process, path, secret)
    os.environ.update(w.environ)
    return w
