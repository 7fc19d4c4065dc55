"""The pipeline on a real one-node Slurm: every job through sbatch, incremental reruns, faults.

The module-scoped `cluster` fixture brings up munge, slurmctld and slurmd with
`.ci/slurm-cluster.sh` (which apt-get installs Debian's packages where they are missing; it
needs root) and takes them down by PID at the end. Snakemake runs with the repository's
profiles (`profiles/slurm`, `profiles/local`), with resources cut to the one 2-CPU node.

Every wait is bounded by what it waits for, and the bounds scale with the machine: at the
start the module reads the load average: with `load` runnable processes on `cores` cores each
gets about cores / load of one, so every limit below is multiplied by the slowdown
max(1, load / cores). A
Snakemake call is a hang when it prints nothing for `IDLE_S` (scaled) seconds: it is killed and
the test fails saying so, while a slow run that keeps printing goes on up to its own limit. The
module's budget (COMPATLAS_SLURM_BUDGET, default 600 s, scaled too) caps the whole. Where Slurm cannot be brought up
(no root, no apt) the module fails and says why;
COMPATLAS_SKIP_SLURM=1 turns it into a reported skip (see `pytest -ra`). One such cluster runs
on a machine at a time: while another test run's is up, the fixture waits for it (at most
COMPATLAS_SLURM_WAIT, 420 s, outside the budget).

Order matters: the tests share one working directory and run top to bottom.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import data_config, machine_slowdown

from compatlas.atlas import connect

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / ".ci" / "slurm-cluster.sh"
BASE_BUDGET_S = float(os.environ.get("COMPATLAS_SLURM_BUDGET", "600"))
# a Snakemake run that prints nothing this long (times the slowdown) is hung: the slowest step
# here (a Slurm job's start-up, status polls 10 s apart and growing) prints within a minute
IDLE_S = 150.0
SNAKEMAKE = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile")]

# The repository's Slurm profile, with requests the one small node can hold (the profile's are
# for real nodes; on the command line these replace the profile's lists). A group job (the
# composition jobs of one model) is as wide as --cores and --resources allow: 2 CPUs, 4 GB.
SLURM_ARGS = [
    "--profile", str(REPO / "profiles" / "slurm"), "--executor", "slurm",
    "--slurm-status-command", "squeue", "--slurm-init-seconds-before-status-checks", "1",
    "--jobs", "8", "--latency-wait", "5",
    "--default-resources", "slurm_partition=debug", "mem_mb=1000", "runtime=10",
    "--set-resources", "extract:mem_mb=3000", "composition:mem_mb=1500", "invariance:mem_mb=2000",
    "induction:mem_mb=3000", "edge_attribution:mem_mb=3000", "metric_audit:mem_mb=1500",
    "--set-threads", "extract=1", "composition=1", "invariance=1", "induction=1", "edge_attribution=1",
    "--cores", "2", "--resources", "mem_mb=4000",
]
LOCAL_ARGS = ["--profile", str(REPO / "profiles" / "local"), "--cores", "2"]
REMOTE_RULES = {"extract", "composition", "calibrate", "invariance", "induction", "edge_attribution", "metric_audit"}
GROUPED_RULES = ("composition", "calibrate")  # one Slurm job per model x checkpoint (profiles/slurm)
LOCAL_RULES = {"atlas", "report", "all"}
ATLAS = ("results/atlas.duckdb",)

_clock = {"start": time.monotonic(), "slowdown": 1.0}  # reset when the cluster fixture starts


def scaled(seconds: float) -> float:
    return seconds * _clock["slowdown"]


def budget() -> float:
    return scaled(BASE_BUDGET_S)


def remaining() -> float:
    return budget() - (time.monotonic() - _clock["start"])


def bounded(limit: float) -> float:
    """`limit` seconds scaled by the machine's slowdown, or what is left of the module's budget if
    that is less."""
    left = remaining()
    if left < 15:
        pytest.fail(f"the Slurm test used up its budget of {budget():.0f} s (COMPATLAS_SLURM_BUDGET "
                    f"{BASE_BUDGET_S:.0f} s x slowdown {_clock['slowdown']:.2f})", pytrace=False)
    return min(scaled(limit), left)


def poll(predicate, limit: float, what: str, interval: float = 0.2):
    """Call `predicate` until it returns something truthy; fail after `limit` seconds."""
    deadline = time.monotonic() + bounded(limit)
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"gave up after {limit:.0f} s waiting for {what}", pytrace=False)


@dataclass
class Cluster:
    dir: Path
    env: dict[str, str]

    def cmd(self, *args: str, limit: float = 20) -> str:
        limit = scaled(limit)
        proc = subprocess.run(["timeout", "-k", "2", str(int(limit)), *args], capture_output=True, text=True,
                              env=self.env, timeout=limit + 10)
        if proc.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
        return proc.stdout

    def ctl_log_size(self) -> int:
        return (self.dir / "log" / "slurmctld.log").stat().st_size

    def submitted_since(self, offset: int) -> set[int]:
        """Job ids of every `sbatch` the controller accepted after `offset` in its log."""
        with open(self.dir / "log" / "slurmctld.log", "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        return {int(j) for j in re.findall(r"_slurm_rpc_submit_batch_job: JobId=(\d+)", text)}

    def jobcomp(self) -> dict[int, str]:
        """Final state of every finished job (jobcomp/filetxt)."""
        path = self.dir / "log" / "jobcomp.log"
        text = path.read_text() if path.exists() else ""
        return {int(j): s for j, s in re.findall(r"JobId=(\d+) .*?JobState=(\S+)", text)}

    def seconds(self, jid: int) -> float:
        """How long a finished job ran, from its job-completion record."""
        from datetime import datetime

        line = re.search(rf"^JobId={jid} .*$", (self.dir / "log" / "jobcomp.log").read_text(), re.M)[0]
        start, end = (datetime.fromisoformat(re.search(rf"{k}=(\S+)", line)[1]) for k in ("StartTime", "EndTime"))
        return (end - start).total_seconds()

    def squeue(self) -> dict[int, str]:
        """State of every job the controller still knows (finished ones for MinJobAge)."""
        out = self.cmd("squeue", "-h", "--states=all", "-o", "%i %T")
        return {int(j): s for j, s in (line.split() for line in out.splitlines() if line.strip())}

    def final_states(self, ids: set[int]) -> dict[int, str]:
        def all_there():
            states = self.jobcomp()
            return states if ids <= states.keys() else None

        return poll(all_there, 30, f"jobs {sorted(ids)} in the job-completion log")

    def cancel_all(self) -> None:
        active = self.cmd("squeue", "-h", "-t", "PENDING,RUNNING,SUSPENDED,COMPLETING", "-o", "%i").split()
        if active:
            self.cmd("scancel", *active)


@pytest.fixture(scope="module")
def cluster():
    if os.environ.get("COMPATLAS_SKIP_SLURM") == "1":
        pytest.skip("COMPATLAS_SKIP_SLURM=1: the real-Slurm tests were skipped on request")
    _clock["start"] = time.monotonic()
    _clock["slowdown"] = machine_slowdown()
    print(f"[slurm test] slowdown {_clock['slowdown']:.2f}: budget {budget():.0f} s, hang after "
          f"{scaled(IDLE_S):.0f} s without output")
    d = Path(tempfile.mkdtemp(prefix="compatlas-slurm-", dir="/tmp"))
    d.chmod(0o755)  # munge and slurm walk into it
    env = {**os.environ, "SLURM_CONF": str(d / "etc" / "slurm.conf")}
    # 4 CPUs on the 2-core machine: the jobs are mostly start-up and waiting; with 2, a group
    # job (2 CPUs) would hold the node alone and the run would go one job at a time
    up_env = {**env, "SLURM_CLUSTER_CPUS": os.environ.get("SLURM_CLUSTER_CPUS", "4")}

    def down():
        subprocess.run(["timeout", "-k", "10", "120", "bash", str(SCRIPT), "down", str(d)], env=env, timeout=150,
                       capture_output=True, text=True)

    # one cluster a machine: while another run's cluster is up (exit 75), wait for it, bounded
    wait_until = time.monotonic() + float(os.environ.get("COMPATLAS_SLURM_WAIT", "420"))
    while True:
        try:
            up = subprocess.run(["timeout", "-k", "10", str(int(bounded(420))), "bash", str(SCRIPT), "up", str(d)],
                                capture_output=True, text=True, env=up_env, timeout=450)
        except subprocess.TimeoutExpired:
            up = subprocess.CompletedProcess([], 124, "", "timed out")
        if up.returncode != 75 or time.monotonic() > wait_until:
            break
        time.sleep(5)
        _clock["start"] = time.monotonic()  # the budget is for this module's own work
    if up.returncode != 0:
        down()
        shutil.rmtree(d, ignore_errors=True)
        pytest.fail(f"could not bring up a one-node Slurm with .ci/slurm-cluster.sh (exit {up.returncode}):\n"
                    f"{up.stderr[-3000:]}\nIt needs root and apt-get (Debian's slurm-wlm and munge). "
                    "Set COMPATLAS_SKIP_SLURM=1 to skip these tests explicitly.", pytrace=False)
    try:
        yield Cluster(d, env)
    finally:
        down()
        if os.environ.get("COMPATLAS_KEEP_SLURM_DIR") != "1":
            shutil.rmtree(d, ignore_errors=True)


@dataclass
class Run:
    rc: int
    out: str
    seconds: float
    remote: Counter = field(default_factory=Counter)  # jobs Snakemake handed to Slurm, by rule
    local: Counter = field(default_factory=Counter)  # jobs it ran itself, by rule
    finished: Counter = field(default_factory=Counter)
    groups: list[str] = field(default_factory=list)
    submitted: dict[int, str] = field(default_factory=dict)  # Slurm job id -> rule_<name> or group_<name>
    submitted_in_ctl: set[int] = field(default_factory=set)


def parse(rc: int, out: str, seconds: float) -> Run:
    return Run(
        rc, out, seconds,
        remote=Counter(re.findall(r"^\s*rule (\w+):$", out, re.M)),
        local=Counter(re.findall(r"^\s*localrule (\w+):$", out, re.M)),
        finished=Counter(re.findall(r"Finished jobid: \S+ \(Rule: (\w+)\)", out)),
        groups=re.findall(r"Group job (\S+) \(jobs in", out),
        submitted={int(j): kind for j, kind in
                   re.findall(r"has been submitted with SLURM jobid (\d+) \(log: \S*?/slurm_logs/([^/\s]+)", out)},
    )


def write_config(work: Path, config: dict) -> None:
    (work / "config.yaml").write_text(yaml.safe_dump(config))


def command(work: Path, limit: float, args: tuple[str, ...], targets: tuple[str, ...]) -> list[str]:
    # targets first: several options take lists (--resources, --configfile) and would eat them
    return ["timeout", "-k", "10", str(int(limit)), *SNAKEMAKE, *targets, "--directory", str(work),
            "--configfile", str(work / "config.yaml"), *args]


def snakemake(cluster: Cluster, work: Path, *args: str, targets: tuple[str, ...] = (), limit: float = 300,
              check: bool = True) -> Run:
    limit = bounded(limit)
    offset = cluster.ctl_log_size()
    t0 = time.monotonic()
    rc, out, hung = watched(command(work, limit, args, targets), cluster.env, limit + 30, scaled(IDLE_S))
    run = parse(rc, out, time.monotonic() - t0)
    print(f"[slurm test] snakemake {' '.join(targets)} {'--dry-run' if '--dry-run' in args else ''}: rc {rc}, "
          f"{run.seconds:.1f} s, {len(run.submitted)} Slurm jobs; {time.monotonic() - _clock['start']:.0f} s into "
          f"the module")
    run.submitted_in_ctl = cluster.submitted_since(offset)
    if hung:
        cluster.cancel_all()
        pytest.fail(f"snakemake {' '.join(args[-3:])} hung: no output for {scaled(IDLE_S):.0f} s:\n{out[-4000:]}",
                    pytrace=False)
    if rc in (124, 137):
        cluster.cancel_all()
        pytest.fail(f"snakemake {' '.join(args[-3:])} ran past {limit:.0f} s:\n{out[-4000:]}", pytrace=False)
    if check and rc != 0:
        pytest.fail(f"snakemake failed ({rc}):\n{out[-6000:]}", pytrace=False)
    return run


def watched(cmd: list[str], env: dict[str, str], limit: float, idle: float) -> tuple[int, str, bool]:
    """Run `cmd`, collecting its output; kill its process group when it prints nothing for `idle`
    seconds (a hang) or runs past `limit`. Returns (exit code, output, hung)."""
    import threading

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: list[str] = []
    last = [time.monotonic()]

    def read():
        for line in proc.stdout:
            lines.append(line)
            last[0] = time.monotonic()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    t0, hung = time.monotonic(), False
    while proc.poll() is None:
        now = time.monotonic()
        if now - last[0] > idle or now - t0 > limit:
            hung = now - last[0] > idle
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            break
        time.sleep(0.2)
    reader.join(timeout=10)
    rc = proc.returncode if not hung and time.monotonic() - t0 <= limit else 124
    return rc, "".join(lines), hung


def start(cluster: Cluster, work: Path, log: Path, *args: str, targets: tuple[str, ...] = (),
          limit: float = 240) -> subprocess.Popen:
    """Snakemake in the background, in its own process group (so that it can be killed whole)."""
    with open(log, "w") as f:
        return subprocess.Popen(command(work, bounded(limit), args, targets), stdout=f, stderr=subprocess.STDOUT,
                                env=cluster.env, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def shards(work: Path) -> list[Path]:
    return sorted((work / "results").rglob("*.parquet"))


def assert_every_shard_opens(work: Path) -> int:
    """Read every Parquet file under results/ whole: none may be truncated."""
    paths = shards(work)
    for p in paths:
        try:
            pq.read_table(p)
        except Exception as e:
            raise AssertionError(f"{p} does not open: {e}") from e
    return len(paths)


def expected_rows(n_layers: int, n_heads: int) -> int:
    return n_layers * (n_layers - 1) // 2 * n_heads**2


def composition_counts(work: Path) -> dict[tuple[str, str], int]:
    con = connect(work / "results" / "atlas.duckdb")
    try:
        return {(m, k): n for m, k, n in con.execute("SELECT model, metric, count(*) FROM composition GROUP BY ALL").fetchall()}
    finally:
        con.close()


def base_config() -> dict:
    return data_config("slurm")


def grown_config() -> dict:
    cfg = base_config()
    cfg["metrics"].append("svd_bound")
    cfg["models"]["tiny-llama"] = {"source": {"kind": "build", "architecture": "llama", "n_layers": 3, "n_heads": 4,
                                              "n_kv_heads": 2, "d_head": 8, "d_vocab": 64, "seed": 1}}
    return cfg


def assert_all_through_slurm(run: Run, cluster: Cluster, planned: Run | None = None) -> dict[int, str]:
    """Every job of a remote rule went to Slurm (in a submission the controller logged, which
    finished COMPLETED); only the local rules ran on the submitting machine."""
    if planned is not None:  # a dry run says `rule` for every job, local or not
        assert run.remote + run.local == planned.remote, (run.remote, run.local, planned.remote)
        assert sorted(run.groups) == sorted(planned.groups)
    assert set(run.remote) <= REMOTE_RULES and set(run.local) <= LOCAL_RULES, (run.remote, run.local)
    assert run.finished == run.remote + run.local, (run.finished, run.remote, run.local)
    # grouped composition jobs travel together: one submission per group, one per other job
    assert all(g.startswith("composition_") for g in run.groups), run.groups
    n_submissions = sum(run.remote.values()) - sum(run.remote[r] for r in GROUPED_RULES) + len(run.groups)
    assert len(run.submitted) == n_submissions, (run.submitted, run.remote, run.groups)
    assert set(run.submitted) == run.submitted_in_ctl, (run.submitted, run.submitted_in_ctl)
    states = cluster.final_states(set(run.submitted))
    assert all(states[j] == "COMPLETED" for j in run.submitted), {j: states[j] for j in run.submitted}
    queue = cluster.squeue()
    assert all(queue.get(j, "COMPLETED") == "COMPLETED" for j in run.submitted), queue
    return states


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    w = tmp_path_factory.mktemp("slurm-run")
    write_config(w, base_config())
    return w


@pytest.fixture(scope="module")
def first_run(cluster: Cluster, work: Path) -> tuple[Run, Run]:
    planned = snakemake(cluster, work, *SLURM_ARGS, "--dry-run", limit=120)
    return planned, snakemake(cluster, work, *SLURM_ARGS)


def test_cluster_is_up(cluster: Cluster):
    assert cluster.cmd("sinfo", "-h", "-o", "%T").split() == ["idle"]
    assert (cluster.dir / "run" / "slurmctld.pid").exists() and (cluster.dir / "run" / "slurmd.pid").exists()


def test_every_job_went_through_sbatch(cluster: Cluster, work: Path, first_run):
    planned, run = first_run
    # the plan, from Snakemake's dry run; every rule but the local ones is a cluster job
    assert set(planned.remote) == REMOTE_RULES | LOCAL_RULES, planned.remote
    assert planned.remote["composition"] == 2  # spaces (x 1 block) of tiny-gpt2: a job scores every metric of its space
    assert planned.groups == ["composition_tiny-gpt2_final"]
    states = assert_all_through_slurm(run, cluster, planned)
    assert set(run.local) == LOCAL_RULES and set(run.remote) == REMOTE_RULES, (run.local, run.remote)
    assert len(states) >= 5
    assert assert_every_shard_opens(work) >= 4
    assert composition_counts(work) == {("tiny-gpt2", m): 2 * 3 * expected_rows(3, 2) for m in ("frobenius", "subspace")}
    assert (work / "results" / "report" / "index.html").exists()


@pytest.fixture(scope="module")
def incremental(cluster: Cluster, work: Path, first_run) -> tuple[Run, dict[Path, str]]:
    assert "Nothing to be done" in snakemake(cluster, work, *SLURM_ARGS, "--dry-run", limit=120).out
    kept = [p for p in shards(work) if "/composition/" in str(p) or "/induction/" in str(p)]
    before = {p: pl.read_parquet(p) for p in kept}
    write_config(work, grown_config())
    return snakemake(cluster, work, *SLURM_ARGS), before


def test_incremental_rerun_submits_only_new_jobs(cluster: Cluster, work: Path, incremental):
    run, before = incremental
    # new model: extract, its 2 spaces' composition, invariance, induction, edge attribution; old model: the new
    # metric's outputs rerun its 2 spaces' jobs; invariance and the metric audit cover every metric, so they rerun too
    # (calibrate: one per model x checkpoint whose composition shards changed, in its group)
    assert run.remote == Counter(extract=1, composition=2 + 2, calibrate=2, invariance=2, induction=1,
                                 edge_attribution=1, metric_audit=1), run.remote
    assert sorted(run.groups) == ["composition_tiny-gpt2_final", "composition_tiny-llama_final"]
    old_model_jobs = re.findall(r"wildcards: model=tiny-gpt2, checkpoint=final, space=(\w+)", run.out)
    assert sorted(old_model_jobs) == ["residual", "token"], old_model_jobs
    assert_all_through_slurm(run, cluster)
    assert len(run.submitted) == 8  # extract, induction, edge attribution, 2 x invariance, metric audit, 2 groups
    # the old metrics' shards come back from the rerun space jobs with the same rows (float64: to rounding)
    changed = [p for p, old in before.items() if not same_rows(pl.read_parquet(p), old)]
    assert not changed, f"old shards changed: {changed}"
    counts = composition_counts(work)
    assert counts == {**{("tiny-gpt2", m): 2 * 3 * expected_rows(3, 2) for m in ("frobenius", "subspace", "svd_bound")},
                      **{("tiny-llama", m): 2 * 3 * expected_rows(3, 4) for m in ("frobenius", "subspace", "svd_bound")}}
    con = connect(work / "results" / "atlas.duckdb")
    assert con.execute("SELECT count(*) FROM head_scores WHERE model = 'tiny-llama'").fetchone()[0] == 3 * 4
    assert con.execute("SELECT count(DISTINCT metric) FROM invariance WHERE model = 'tiny-gpt2'").fetchone()[0] == 3


def model_shards(work: Path, model: str) -> list[Path]:
    return sorted((work / "results" / "composition" / f"model={model}").rglob("*.parquet"))


def complete_spaces(work: Path, model: str) -> int:
    """The spaces of which every composition shard (3 metrics, causal and null) was on disk before a rerun."""
    spaces = {"residual", "token"}
    return sum(all((work / "results" / kind / f"model={model}" / "checkpoint=final" / f"metric={m}" / f"space={s}"
                    / "block=0.parquet").exists() for kind in ("composition", "composition_null")
                   for m in ("frobenius", "subspace", "svd_bound")) for s in spaces)


def same_rows(new: pl.DataFrame, old: pl.DataFrame) -> bool:
    """The same rows, floats to 1e-12 relative (a job scoring another metric beside them may tile its GEMMs otherwise)."""
    if new.columns != old.columns or new.height != old.height:
        return False
    floats = [c for c, t in new.schema.items() if t.is_float()]
    if not new.drop(floats).equals(old.drop(floats)):
        return False
    return all(np.allclose(new[c].to_numpy(), old[c].to_numpy(), rtol=1e-12, atol=1e-15, equal_nan=True) for c in floats)


def forget(work: Path, model: str) -> None:
    """Take a model's composition shards and the atlas away, as if the run had not got there
    (with the atlas up to date, Snakemake 9 would not remake missing intermediate shards)."""
    shutil.rmtree(work / "results" / "composition" / f"model={model}")
    (work / "results" / "atlas.duckdb").unlink()


def test_scancel_of_a_running_job_then_rerun_completes(cluster: Cluster, work: Path, incremental, tmp_path: Path):
    forget(work, "tiny-llama")
    log = tmp_path / "cancelled.log"
    proc = start(cluster, work, log, *SLURM_ARGS, targets=ATLAS)
    try:
        running = poll(lambda: [j for j, s in cluster.squeue().items() if s == "RUNNING"] or proc.poll() is not None,
                       120, "the composition job to run")
        assert isinstance(running, list), f"snakemake ended before any job ran:\n{log.read_text()[-3000:]}"
        jid = running[0]
        # let it get mid-way: a shard or two written, the rest still to come (at most 10 s)
        deadline = time.monotonic() + 10
        while not model_shards(work, "tiny-llama") and time.monotonic() < deadline:
            time.sleep(0.2)
        cluster.cmd("scancel", str(jid))
        rc = proc.wait(timeout=bounded(120))
    finally:
        stop(proc)
    out = log.read_text()
    assert rc != 0, out[-3000:]
    # Snakemake names the failed group job and its Slurm log, which says the job was cancelled
    assert "Error in group composition_tiny-llama_final" in out, out[-3000:]
    slurm_log = re.search(rf"\S*/slurm_logs/group_composition_tiny-llama_final\S*/{jid}\.log", out)
    assert slurm_log and f"JOB {jid} ON" in Path(slurm_log[0]).read_text() and "CANCELLED" in Path(slurm_log[0]).read_text()
    assert cluster.final_states({jid})[jid].startswith("CANCELLED")
    assert_every_shard_opens(work)
    left, complete = len(model_shards(work, "tiny-llama")), complete_spaces(work, "tiny-llama")
    run = snakemake(cluster, work, *SLURM_ARGS, targets=ATLAS)
    # edge attribution stratifies its exact sample over composition shards made in the cancelled group job, so it
    # had not run yet: the rerun runs it once, with what the cancel left
    assert 2 - complete <= run.remote["composition"] <= 2 and run.remote["calibrate"] == 1, (run.remote, left)
    assert run.remote["edge_attribution"] == 1, run.remote
    assert_all_through_slurm(run, cluster)
    assert len(model_shards(work, "tiny-llama")) == 6
    assert_every_shard_opens(work)
    assert composition_counts(work)[("tiny-llama", "svd_bound")] == 2 * 3 * expected_rows(3, 4)


def test_killed_local_run_then_rerun_completes(cluster: Cluster, work: Path, incremental, tmp_path: Path):
    forget(work, "tiny-gpt2")
    log = tmp_path / "killed.log"
    # one core: one space's job at a time, so the kill at its first shard lands mid-way (with two, both spaces'
    # jobs wrote their shards within 60 ms of each other); the next job's shards are a job start-up away
    proc = start(cluster, work, log, *LOCAL_ARGS[:-1], "1", targets=ATLAS)
    try:
        poll(lambda: model_shards(work, "tiny-gpt2") or proc.poll() is not None, 120, "the local run's first shard",
             interval=0.02)
        assert proc.poll() is None, f"the local run ended ({proc.returncode}) before it could be killed:\n{log.read_text()[-3000:]}"
        os.killpg(proc.pid, signal.SIGKILL)  # the whole process group: snakemake and its jobs
        proc.wait(timeout=30)
    finally:
        stop(proc)
    written, complete = len(model_shards(work, "tiny-gpt2")), complete_spaces(work, "tiny-gpt2")
    assert 1 <= written <= 3, f"{written} shards: the run was not killed mid-way\n{log.read_text()[-2000:]}"
    assert_every_shard_opens(work)
    # the killed run's lock stays; the user is told to unlock
    locked = snakemake(cluster, work, *LOCAL_ARGS, targets=ATLAS, check=False, limit=120)
    assert locked.rc != 0 and "cannot be locked" in locked.out, locked.out[-2000:]
    snakemake(cluster, work, "--unlock", limit=120)
    run = snakemake(cluster, work, *LOCAL_ARGS, targets=ATLAS)
    # the spaces whose shards are missing, plus any whose job was killed before Snakemake recorded it
    assert 2 - complete <= run.local["composition"] <= 2, (run.local, written)
    assert len(model_shards(work, "tiny-gpt2")) == 6
    assert_every_shard_opens(work)
    assert composition_counts(work)[("tiny-gpt2", "frobenius")] == 2 * 3 * expected_rows(3, 2)


def test_bad_input_fails_fast_with_its_message_in_the_log(cluster: Cluster, work: Path, incremental, tmp_path: Path):
    bad = tmp_path / "bad"
    shutil.copytree(work, bad, symlinks=True)
    # a lock left by an earlier test that failed before its --unlock would fail this run before any job
    shutil.rmtree(bad / ".snakemake" / "locks", ignore_errors=True)
    weights = bad / "results" / "weights" / "tiny-llama" / "final" / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    target = "results/composition/model=tiny-llama/checkpoint=final/metric=frobenius/space=residual/block=0.parquet"
    (bad / target).unlink()
    run = snakemake(cluster, bad, *SLURM_ARGS, targets=(target,), check=False, limit=180)
    assert run.rc != 0, run.out[-3000:]
    assert run.seconds < scaled(120), f"the failing job took {run.seconds:.0f} s (limit {scaled(120):.0f} s)"
    log = bad / "results" / "logs" / "composition" / "tiny-llama" / "final" / "residual-0.log"
    assert "is corrupt or truncated" in log.read_text() and "weights.safetensors" in log.read_text(), run.out[-3000:]
    # Snakemake reports it, names the rule's log and prints it (show-failed-logs)
    assert "Error in rule composition" in run.out and str(log.relative_to(bad)) in run.out, run.out[-3000:]
    assert "CorruptShardError" in run.out and "is corrupt or truncated" in run.out, run.out[-3000:]
    assert len(run.submitted) == 1 and set(run.submitted) == run.submitted_in_ctl
    (jid,) = run.submitted
    assert cluster.final_states({jid})[jid] == "FAILED"
    assert cluster.seconds(jid) < scaled(60), f"the Slurm job ran {cluster.seconds(jid):.0f} s before failing"
    assert not (bad / target).exists() and not list((bad / target).parent.glob(".*.tmp"))
