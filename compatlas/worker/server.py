"""The job server of ``compatlas.worker``: one process that imports what the pipeline's scripts
import, then forks a child per job that runs the job's script from the top (the why and the
guarantees: ``compatlas.worker``'s docstring). Run by ``worker.start`` as
``python -m compatlas.worker.server SOCKET PARENT_PID SCRIPTS_DIR COMMON REQUEST_TIMEOUT_S``, with the
run's secret in its environment (``worker.SECRET_ENV``)."""

from __future__ import annotations

import ast
import contextlib
import importlib
import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compatlas import worker
from compatlas.worker import HEADER, remove
from compatlas.worker.admission import MAX_REQUEST, BadRequest, check_request, descends_from, peer, say
from compatlas.worker.child import die_with, run_child

KILL_GRACE_S = 5.0  # after SIGTERM, a cancelled job's child gets this long before SIGKILL
MAX_PENDING = 256  # connections still sending their request; past it a new one is refused


def script_imports(scripts: list[Path]) -> list[str]:
    """The modules the pipeline's scripts import at their top level, in first-seen order: what the
    server imports for every job."""
    seen: dict[str, None] = {}
    for script in scripts:
        for node in ast.parse(script.read_text()).body:
            if isinstance(node, ast.Import):
                seen.update(dict.fromkeys(a.name for a in node.names))
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                seen.update(dict.fromkeys([node.module]))
    return [m for m in seen if m != "compatlas.worker"]


@dataclass
class _Job:
    conn: socket.socket
    pid: int
    killed_at: float | None = None


@dataclass
class _Pending:
    """A connection whose request is still arriving (read as it comes: a slow or silent client
    holds up no one)."""

    conn: socket.socket
    deadline: float
    who: str  # "pid N (uid U)", for the log
    stranger: str | None  # why its peer is not of this run, None where it is (or cannot be told)
    data: bytearray = field(default_factory=bytearray)
    fds: list[int] = field(default_factory=list)


# Imported first: what every script needs, then (after the scripts' own imports) what the model
# scripts import inside their functions, transformers above all (about 4 s of a job on the idle
# machine, 17 s under load)
PRELOAD_FIRST = ("torch", "numpy", "polars")
PRELOAD_LAST = ("transformers", "transformer_lens", "transformer_lens.model_bridge")


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    """The variables the Hugging Face libraries read once, when imported (their caches, tokens,
    endpoints). A job whose values differ from the server's cannot use modules the server imported
    with its own. ``HF_HUB_OFFLINE`` is left out: the server imports them offline (a model not
    from the hub needs no network, and its script says so before ``hand_off``), and a job that
    needs the hub says so (``hand_off(network=True)``)."""
    return {k: v for k, v in env.items() if k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_")) and k != "HF_HUB_OFFLINE"}


@dataclass
class _Server:
    sock: socket.socket
    parent: int
    preload: list[str]
    secret: str = ""
    request_timeout_s: float = worker.REQUEST_TIMEOUT_S
    sel: selectors.DefaultSelector = field(default_factory=selectors.DefaultSelector)
    jobs: dict[int, _Job] = field(default_factory=dict)  # by pid
    pending: dict[int, _Pending] = field(default_factory=dict)  # by the connection's fd
    wakeup: tuple[int, int] = (-1, -1)  # a pipe a child's exit writes to (SIGCHLD): its job ends at once
    t0: float = field(default_factory=time.monotonic)

    def run(self) -> None:
        self.sel.register(self.sock, selectors.EVENT_READ)
        self.wakeup = os.pipe()
        for fd in self.wakeup:
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self.wakeup[1])
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.sel.register(self.wakeup[0], selectors.EVENT_READ)
        while os.getppid() == self.parent:
            # import one module whenever nothing waits: the first jobs are not held up by all of them
            events = self.sel.select(timeout=0 if self.preload else self._wait())
            if not events and self.preload:
                self._import(self.preload.pop(0))
                if not self.preload:
                    print(f"imported the jobs' modules in {time.monotonic() - self.t0:.1f}s", file=sys.stderr, flush=True)
            for key, _ in events:
                try:
                    if key.fileobj is self.sock:
                        self._accept()
                    elif key.fileobj == self.wakeup[0]:
                        self._drain_wakeup()
                    elif isinstance(key.data, _Pending):
                        self._read(key.data)
                    else:
                        self._lost(key.data)
                except Exception as e:  # noqa: BLE001 (one client's trouble is a line of the log, never the server's end)
                    say(f"error serving a connection: {type(e).__name__}: {e}")
                    if isinstance(key.data, _Pending):
                        self._drop(key.data)
            self._expire()
            self._reap()
        self.kill_all()

    def _wait(self) -> float:
        """How long select may wait: a second, or until the first pending request's deadline."""
        first = min((p.deadline for p in self.pending.values()), default=time.monotonic() + 1.0)
        return max(0.0, min(1.0, first - time.monotonic()))

    def _drain_wakeup(self) -> None:
        while True:
            try:
                if not os.read(self.wakeup[0], 512):
                    break
            except BlockingIOError:
                break

    def close_in_child(self) -> None:
        """A forked child keeps none of the server's descriptors nor its SIGCHLD wake-up."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.sock.close()
        for fd in self.wakeup:
            os.close(fd)
        for job in self.jobs.values():
            job.conn.close()
        for p in self.pending.values():
            p.conn.close()
            for fd in p.fds:
                os.close(fd)

    def _import(self, name: str) -> None:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 (a job that needs it will say why; the server serves the others)
            print(f"preload {name}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
            raise SystemExit(f"importing {name} initialised CUDA, which a forked job cannot use: not serving")

    def _accept(self) -> None:
        conn, _ = self.sock.accept()
        conn.setblocking(False)
        creds = peer(conn)
        who, stranger = "a process", None
        if creds is not None:
            pid, uid = creds
            who = f"pid {pid} (uid {uid})"
            if uid != os.getuid():
                stranger = f"it runs as uid {uid}, not {os.getuid()}"
            elif descends_from(pid, self.parent) is False:
                stranger = f"it is not a process of this run (Snakemake's pid {self.parent})"
        if len(self.pending) >= MAX_PENDING:
            say(f"refused a request from {who}: {MAX_PENDING} connections are already sending theirs")
            conn.close()
            return
        p = _Pending(conn, time.monotonic() + self.request_timeout_s, who, stranger)
        self.pending[conn.fileno()] = p
        self.sel.register(conn, selectors.EVENT_READ, data=p)

    def _drop(self, p: _Pending, why: str | None = None) -> None:
        """Close a pending connection (and the descriptors it sent), saying why in the log."""
        if why is not None:
            say(f"refused a request from {p.who}: {why}")
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(p.conn)
        self.pending.pop(p.conn.fileno(), None)
        for fd in p.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        p.fds.clear()
        p.conn.close()

    def _expire(self) -> None:
        now = time.monotonic()
        for p in [p for p in self.pending.values() if now > p.deadline]:
            self._drop(p, p.stranger or f"it sent {len(p.data)} bytes of its request in {self.request_timeout_s:g} s")

    def _read(self, p: _Pending) -> None:
        """Read what has arrived of ``p``'s request; serve it once whole."""
        size = HEADER.unpack(bytes(p.data[:HEADER.size]))[0] if len(p.data) >= HEADER.size else None
        want = HEADER.size - len(p.data) if size is None else HEADER.size + size - len(p.data)
        try:
            chunk, fds, flags, _ = socket.recv_fds(p.conn, min(want, 1 << 16), 3)
        except BlockingIOError:
            return
        except OSError as e:
            self._drop(p, f"its connection failed: {e}")
            return
        p.fds += fds
        if flags & getattr(socket, "MSG_CTRUNC", 0) or len(p.fds) > 3:  # the system dropped those past the 3 asked for
            self._drop(p, "it sent more than 3 file descriptors, not its 3 standard streams")
            return
        if not chunk:
            # nothing at all: another run's start probing whether this server lives (worker._sweep)
            self._drop(p, None if not p.data and not p.fds else f"it closed its connection after {len(p.data)} bytes")
            return
        if p.stranger is not None:
            self._drop(p, p.stranger)
            return
        p.data += chunk
        if size is None and len(p.data) >= HEADER.size:
            size = HEADER.unpack(bytes(p.data[:HEADER.size]))[0]
            if size > MAX_REQUEST:
                self._drop(p, f"its request would be {size:,} bytes, more than {MAX_REQUEST:,}")
                return
        if size is None or len(p.data) < HEADER.size + size:
            return
        try:
            if len(p.fds) != 3:
                raise BadRequest(f"it sent {len(p.fds)} file descriptors, not its 3 standard streams")
            request = check_request(json.loads(bytes(p.data[HEADER.size:])), self.secret)
        except (BadRequest, ValueError) as e:
            self._drop(p, str(e) if isinstance(e, BadRequest) else f"its request is not JSON: {e}")
            return
        self.sel.unregister(p.conn)
        del self.pending[p.conn.fileno()]
        fds, p.fds = p.fds, []  # the request's now: never closed twice
        p.conn.setblocking(True)
        p.conn.settimeout(self.request_timeout_s)  # the answers are a few bytes: never a wait, unless the job stalls
        self._serve(p.conn, request, fds)

    def _serve(self, conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
        """Fork the child that runs ``request``'s script, or answer why not."""
        hf_loaded = "huggingface_hub" in sys.modules or "transformers" in sys.modules
        if hf_loaded and (request["network"] or import_time_env(request["env"]) != import_time_env(dict(os.environ))):
            for fd in fds:  # imported with other settings than the job's: it runs in its own process
                os.close(fd)
            with contextlib.suppress(OSError):
                conn.sendall(b"N")
            conn.close()
            return
        server = os.getpid()
        try:
            pid = os.fork()
        except OSError as e:
            for fd in fds:
                os.close(fd)
            say(f"could not fork a job ({e}): it runs in its own process")
            conn.close()
            return
        if pid == 0:
            try:
                die_with(server)
                self.close_in_child()
                run_child(request, fds, keep=conn, server=server)
            finally:
                os._exit(1)
        for fd in fds:
            os.close(fd)
        self.jobs[pid] = _Job(conn, pid)
        try:
            conn.sendall(b"S")
        except OSError:  # the job's process went away meanwhile: so does its child
            self._lost(pid)
            return
        self.sel.register(conn, selectors.EVENT_READ, data=pid)

    def _lost(self, pid: int) -> None:
        """The job's process closed its end (it was cancelled or killed): its child goes too."""
        job = self.jobs.get(pid)
        if job is not None and job.killed_at is None:
            _signal(pid, signal.SIGTERM)
            job.killed_at = time.monotonic()
            with contextlib.suppress(KeyError, ValueError):  # not yet registered when its hello failed
                self.sel.unregister(job.conn)

    def _reap(self) -> None:
        for pid, job in list(self.jobs.items()):
            if job.killed_at is not None and time.monotonic() - job.killed_at > KILL_GRACE_S:
                _signal(pid, signal.SIGKILL)
            done, status = os.waitpid(pid, os.WNOHANG)
            if done == 0:
                continue
            code = os.waitstatus_to_exitcode(status)
            try:
                job.conn.sendall(struct.pack("!i", code if code >= 0 else 128 - code))
            except OSError:
                pass
            if job.killed_at is None:
                with contextlib.suppress(KeyError, ValueError):
                    self.sel.unregister(job.conn)
            job.conn.close()
            del self.jobs[pid]

    def kill_all(self) -> None:
        for pid in self.jobs:
            _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def serve(path: str, parent: int, scripts_dir: Path, common: bool = True,
          request_timeout_s: float = worker.REQUEST_TIMEOUT_S) -> None:
    """Listen on ``path`` until process ``parent`` (Snakemake's) is gone or stops the server,
    importing the scripts' modules while it waits (with ``common``, PRELOAD_FIRST and _LAST too).
    A request must carry the secret this process inherited (``worker.SECRET_ENV``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is Snakemake's to handle; it stops us
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # is_available() without a CUDA context
    os.environ["HF_HUB_OFFLINE"] = "1"  # the Hugging Face libraries imported offline (import_time_env)
    secret = os.environ.get(worker.SECRET_ENV, "")
    if not secret:
        raise SystemExit(f"no {worker.SECRET_ENV} in the environment: not serving (worker.start sets it)")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(256)
    first, last = (PRELOAD_FIRST, PRELOAD_LAST) if common else ((), ())
    preload = list(dict.fromkeys([*first, *script_imports(sorted(scripts_dir.glob("*.py"))), *last]))
    server = _Server(sock, parent, preload, secret, request_timeout_s)

    def stop(*_: Any) -> None:
        server.kill_all()
        remove(path)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    try:
        server.run()
    finally:
        remove(path)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] == "1", float(sys.argv[5]))
