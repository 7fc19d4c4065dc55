"""The job server (compatlas/worker/): a script handed off runs in a fork of the server with the
job's streams, directory, environment and arguments, and its process exits with the script's
status; a cancelled job's fork dies with it; without a server the script runs in its own process.

Each test starts a server on a scripts folder of its own (what it imports: a small module, so the
tests do not wait for torch) and runs "job" scripts that stand for what Snakemake runs: a file
that calls ``hand_off`` first, run by a fresh interpreter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from compatlas import worker
from compatlas.worker import server as worker_server

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the job server forks: POSIX only")

JOB = """
import os, sys
from compatlas.worker import hand_off
hand_off(None)
import json
print(json.dumps({{"pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(), "argv": sys.argv,
                  "var": os.environ.get("JOB_VAR"), "json_loaded_before": {loaded}}}))
sys.stderr.write("to stderr\\n")
{tail}
"""


def job(tmp_path: Path, tail: str = "", name: str = "job.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(JOB.format(loaded="'colorsys' in sys.modules", tail=tail)))
    return path


def run(script: Path, served: dict[str, str] | None, cwd: Path, **kw) -> subprocess.CompletedProcess:
    """Run a job script as Snakemake would, with ``served`` (a server's ``environ``) in its environment."""
    env = {**os.environ, "JOB_VAR": "x1"}
    env.pop(worker.ENV, None)
    env.pop(worker.SECRET_ENV, None)
    env.update(served or {})
    return subprocess.run([sys.executable, str(script), "arg"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120, **kw)


def test_a_handed_off_job_runs_in_the_server_with_its_own_streams_directory_and_environment(server, tmp_path):
    import json

    ready(tmp_path / "worker.log")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    proc = run(job(tmp_path, "sys.exit(3)"), server.environ, elsewhere)
    assert proc.returncode == 3, proc.stderr
    out = json.loads(proc.stdout)
    assert out["ppid"] == server.process.pid  # a fork of the server, not the job's own process
    assert out["cwd"] == str(elsewhere) and out["argv"] == [str(tmp_path / "job.py"), "arg"] and out["var"] == "x1"
    assert out["json_loaded_before"]  # imported by the server, before the job's own imports
    assert proc.stderr == "to stderr\n"


def test_the_exit_status_and_the_traceback_of_a_failing_job_come_back(server, tmp_path):
    proc = run(job(tmp_path, "raise ValueError('bad input')"), server.environ, tmp_path)
    assert proc.returncode == 1
    assert "ValueError: bad input" in proc.stderr and "Traceback" in proc.stderr
    killed = run(job(tmp_path, "os.kill(os.getpid(), 9)", "k.py"), server.environ, tmp_path)
    assert killed.returncode == 128 + 9  # a shell's convention for a job killed by a signal


def test_without_a_server_the_job_runs_in_its_own_process(tmp_path):
    import json

    alone = run(job(tmp_path), None, tmp_path)
    gone = run(job(tmp_path, name="j2.py"), {worker.ENV: str(tmp_path / "no-such-socket")}, tmp_path)
    for proc in (alone, gone):
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["ppid"] != 1 and not json.loads(proc.stdout)["json_loaded_before"]


def test_a_cancelled_job_takes_its_fork_with_it(server, tmp_path):
    marker = tmp_path / "child.pid"
    script = job(tmp_path, f"open({str(marker)!r}, 'w').write(str(os.getpid()))\nimport time\ntime.sleep(300)")
    env = {**os.environ, **server.environ}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(0.05)
    child = int(marker.read_text())
    proc.send_signal(signal.SIGTERM)  # what Snakemake does to a job it cancels
    proc.wait(30)
    deadline = time.monotonic() + 30
    while alive(child):
        assert time.monotonic() < deadline, "the job's fork outlived its job"
        time.sleep(0.05)


def test_a_hub_job_and_one_whose_hub_settings_differ_run_in_their_own_process(tmp_path):
    """The Hugging Face libraries read their settings when imported, and the server imports them
    offline: a job that needs the hub, or sets another cache, cannot use them."""
    import json

    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "a.py").write_text("import huggingface_hub\n")
    w = worker.start(tmp_path, scripts, tmp_path / "worker.log", common=False)
    assert w is not None
    for name in w.environ:
        os.environ.pop(name)
    try:
        ready(tmp_path / "worker.log")
        same = {**os.environ, **w.environ}
        hub = job(tmp_path, name="hub.py")
        hub.write_text(hub.read_text().replace("hand_off(None)", "hand_off(None, network=True)"))
        runs = [(job(tmp_path, name="same.py"), same), (job(tmp_path, name="home.py"), {**same, "HF_HOME": str(tmp_path)}),
                (hub, same)]
        outs = [subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
                for script, env in runs]
        assert [json.loads(o.stdout)["ppid"] == w.process.pid for o in outs] == [True, False, False], [o.stderr for o in outs]
    finally:
        w.stop()


def test_the_server_leaves_when_its_snakemake_is_gone(tmp_path):
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    log = tmp_path / "w.log"
    code = (f"from compatlas import worker; w = worker.start({str(tmp_path)!r}, {str(scripts)!r}, {str(log)!r}, common=False); "
            "print(w.process.pid, w.socket_path, flush=True); import os; os._exit(0)")  # Snakemake killed: no stop()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    pid, socket_path = out.stdout.split()
    deadline = time.monotonic() + 30
    while alive(int(pid)):
        assert time.monotonic() < deadline, "the server outlived its Snakemake"
        time.sleep(0.1)
    assert not Path(socket_path).parent.exists()  # its socket and private folder went with it


def test_a_killed_servers_folder_is_swept_by_the_next_start(tmp_path):
    import socket
    import tempfile

    stale = Path(tempfile.mkdtemp(prefix="compatlas-worker-"))
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale / "socket"))  # bound, never listening again: what a SIGKILLed server leaves
    s.close()
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    w = worker.start(tmp_path, scripts, tmp_path / "w.log", common=False)
    assert w is not None
    for name in w.environ:
        os.environ.pop(name)
    try:
        assert not stale.exists() and Path(w.socket_path).exists()
    finally:
        w.stop()


def test_the_server_imports_what_the_pipeline_scripts_import():
    modules = worker_server.script_imports(sorted((Path(__file__).parents[1] / "scripts").glob("*.py")))
    assert {"compatlas.composition.shard_job", "polars", "compatlas.logs"} <= set(modules)
    assert "compatlas.worker" not in modules


def ready(log: Path) -> None:
    """Wait until the server has imported its modules (its log says so)."""
    deadline = time.monotonic() + 300
    while "imported the jobs' modules" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) is gone for our purpose
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


PINNED_JOB = """
import json, os, sys
from compatlas.worker import hand_off, run_fresh
hand_off(None)
from compatlas.runtime import _mkl_cbwr_branch, pin_cpu_kernels
if not pin_cpu_kernels():
    run_fresh()
import torch
print(json.dumps({"ppid": os.getppid(), "fresh": os.environ.get("COMPATLAS_WORKER") == "off",
                  "capability": torch.backends.cpu.get_cpu_capability(), "branch": _mkl_cbwr_branch()}))
"""


@pytest.mark.skipif(not __import__("torch").cpu._is_avx2_supported(),
                    reason="this CPU has no AVX2: the pin (AVX2 kernels) cannot be taken, so there is nothing to check")
@pytest.mark.parametrize("server_used_torch", [False, True])
def test_a_pinned_job_takes_its_pin_in_the_fork_or_reruns_in_a_fresh_process(tmp_path, server_used_torch):
    """Training pins torch's and MKL's CPU kernels (compatlas.runtime.pin_cpu_kernels), which are read
    once, on first use. In the fork of a server that imported torch and never ran it, the pin takes
    there; in that of a server that ran torch (its kernels chosen), the job re-executes itself as a
    fresh process (``run_fresh``: the same pid, so still the server's child) and is pinned there.
    Either way its kernels are those of a process pinned before torch was imported."""
    import json

    (tmp_path / "spoil.py").write_text("import torch\ntorch.ones(2) + 1\n" if server_used_torch else "import torch\n")
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "a.py").write_text("import spoil\n")  # what the server imports: torch, run or not
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        w = worker.start(tmp_path, scripts, tmp_path / "worker.log", common=False)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert w is not None
    try:
        ready(tmp_path / "worker.log")
        script = tmp_path / "pinned.py"
        script.write_text(textwrap.dedent(PINNED_JOB))
        proc = subprocess.run([sys.executable, str(script)], env={**env, **w.environ}, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        own = subprocess.run([sys.executable, "-c", "from compatlas.runtime import pin_cpu_kernels, _mkl_cbwr_branch; "
                              "pin_cpu_kernels(); import torch; torch.ones(2) + 1; "
                              "print(torch.backends.cpu.get_cpu_capability(), _mkl_cbwr_branch())"],
                             env={k: v for k, v in env.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")},
                             capture_output=True, text=True, timeout=300, check=True).stdout.split()
        assert out["ppid"] == w.process.pid  # the server's fork, re-executed or not
        assert out["fresh"] is server_used_torch
        assert [out["capability"], str(out["branch"])] == own  # what a process pinned before importing torch has
        assert out["capability"] == "AVX2"
    finally:
        w.stop()


WHERE_20_MIB_GOES = """
import ctypes
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
first = libc.malloc(20 << 20)  # a tensor's buffer (torch's CPU allocator is malloc)
where = next((line.split()[5:] or ["anonymous"])[0] for line in open("/proc/self/maps")
             if int(line.split("-")[0], 16) <= first < int(line.split()[0].split("-")[1], 16))
libc.free(first)
print(where, libc.malloc(20 << 20) == first)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="GLIBC_TUNABLES and /proc/self/maps are Linux's")
def test_the_jobs_allocator_serves_large_tensors_from_the_heap_and_reuses_them():
    """runtime.JOB_MALLOC: a 20 MiB buffer comes from the heap, and once freed the next one reuses
    it. glibc's defaults (or a user's own GLIBC_TUNABLES, which the run leaves alone) map it anew
    (an anonymous mapping, its pages zeroed by the kernel on first touch) and unmap it on free.
    benchmarks/bench_allocator.py measures what that saves a job (SmolLM2's exact patching: 4.3
    million page faults down to 0.4 million)."""
    from compatlas.runtime import JOB_MALLOC, job_environment

    assert job_environment({}) == {"GLIBC_TUNABLES": JOB_MALLOC}
    assert job_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {}  # the user's, kept
    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}

    def where(env: dict[str, str]) -> list[str]:
        return subprocess.run([sys.executable, "-c", WHERE_20_MIB_GOES], env=env, capture_output=True, text=True,
                              check=True, timeout=120).stdout.split()

    assert where(base)[0] == "anonymous"  # glibc's default: a map of its own
    assert where(base | job_environment(base)) == ["[heap]", "True"]
