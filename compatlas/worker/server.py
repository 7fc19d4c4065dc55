"""The job server of ``compatlas.worker``: one process that imports what the pipeline's scripts
import, then forks a child per job that runs the job's script from the top (the why and the
guarantees: ``compatlas.worker``'s docstring). Run by ``worker.start`` as
``python -m compatlas.worker.server SOCKET PARENT_PID SCRIPTS_DIR COMMON``."""

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
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compatlas import worker
from compatlas.worker import HEADER, remove

KILL_GRACE_S = 5.0  # after SIGTERM, a cancelled job's child gets this long before SIGKILL


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
    sel: selectors.DefaultSelector = field(default_factory=selectors.DefaultSelector)
    jobs: dict[int, _Job] = field(default_factory=dict)  # by pid
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
            events = self.sel.select(timeout=0 if self.preload else 1.0)
            if not events and self.preload:
                self._import(self.preload.pop(0))
                if not self.preload:
                    print(f"imported the jobs' modules in {time.monotonic() - self.t0:.1f}s", file=sys.stderr, flush=True)
            for key, _ in events:
                if key.fileobj is self.sock:
                    self._accept()
                elif key.fileobj == self.wakeup[0]:
                    while True:
                        try:
                            if not os.read(self.wakeup[0], 512):
                                break
                        except BlockingIOError:
                            break
                else:
                    self._lost(key.data)
            self._reap()
        self.kill_all()

    def close_in_child(self) -> None:
        """A forked child keeps none of the server's descriptors nor its SIGCHLD wake-up."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.sock.close()
        for fd in self.wakeup:
            os.close(fd)
        for job in self.jobs.values():
            job.conn.close()

    def _import(self, name: str) -> None:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 (a job that needs it will say why; the server serves the others)
            print(f"preload {name}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
            raise SystemExit(f"importing {name} initialised CUDA, which a forked job cannot use: not serving")

    def _accept(self) -> None:
        conn, _ = self.sock.accept()
        try:
            head, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
            if not head:  # another run's start probing whether this server lives (_sweep)
                conn.close()
                return
            (size,) = HEADER.unpack(head)
            body = b""
            while len(body) < size:
                chunk = conn.recv(size - len(body))
                if not chunk:
                    raise OSError("the job closed its connection")
                body += chunk
            request = json.loads(body)
        except (OSError, ValueError, struct.error) as e:
            print(f"a job's request was unreadable: {e}", file=sys.stderr, flush=True)
            conn.close()
            return
        hf_loaded = "huggingface_hub" in sys.modules or "transformers" in sys.modules
        if hf_loaded and (request.get("network") or import_time_env(request["env"]) != import_time_env(dict(os.environ))):
            for fd in fds:  # imported with other settings than the job's: it runs in its own process
                os.close(fd)
            conn.sendall(b"N")
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            self.close_in_child()
            _child(request, fds, keep=conn)
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


def _child(request: dict[str, Any], fds: list[int], keep: socket.socket) -> None:
    """The forked job: the streams, directory, environment and arguments of the job's process,
    then its script from the top (this module's ``hand_off`` now returns). Never returns."""
    worker._IN_CHILD = True  # the script's hand_off now returns
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


def serve(path: str, parent: int, scripts_dir: Path, common: bool = True) -> None:
    """Listen on ``path`` until process ``parent`` (Snakemake's) is gone or stops the server,
    importing the scripts' modules while it waits (with ``common``, PRELOAD_FIRST and _LAST too)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is Snakemake's to handle; it stops us
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # is_available() without a CUDA context
    os.environ["HF_HUB_OFFLINE"] = "1"  # the Hugging Face libraries imported offline (import_time_env)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(256)
    first, last = (PRELOAD_FIRST, PRELOAD_LAST) if common else ((), ())
    preload = list(dict.fromkeys([*first, *script_imports(sorted(scripts_dir.glob("*.py"))), *last]))
    server = _Server(sock, parent, preload)

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
    serve(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] == "1")
