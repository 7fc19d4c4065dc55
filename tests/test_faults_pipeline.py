"""Faults through Snakemake on the two random toy models (frobenius x residual, 2 blocks): kill -9
at each rule, a full disk, a truncated or flipped composition shard, a truncated head-score
shard, a crashed read-write session's WAL, two runs at once. Each ends with the clean run's
numbers, or a one-line error naming the file and then, following its advice, the clean
numbers. Slow (several minutes on 2 cores): ``pytest -m slow tests/test_faults_pipeline.py``."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import machine_slowdown

from compatlas.atlas import query
from compatlas.atlas.files import SESSIONS, wal_path
from compatlas.storage import bad_shards

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
# no --nolock: compatlas's run lock (and the leftover temp files it clears) is part of what is tested
SNAKEMAKE = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--cores", "2"]
CONFIG = {
    "results": "results", "device": "cpu", "dtype": "float64", "metrics": ["frobenius"], "spaces": ["residual"],
    "composition": {"blocks": 2, "baseline_samples": 8, "seed": 0},
    "models": {
        "toy-gpt2": {"source": {"kind": "build", "architecture": "gpt2", "n_layers": 3, "n_heads": 2, "d_head": 8,
                                "d_vocab": 64, "seed": 0}, "processing": "compat"},
        "toy-llama": {"source": {"kind": "build", "architecture": "llama", "n_layers": 3, "n_heads": 4, "n_kv_heads": 2,
                                 "d_head": 8, "d_vocab": 64, "seed": 1}},
    },
    "induction": {"tokens": 6, "sequences": 4, "pool": 48, "head_scores": {"sequences": 8, "length": 10},
                  "ablation": {"sequences": 4}},
}
NUMBERS = {  # what the atlas answers, compared with the clean run's
    "composition": "SELECT model, count(*), round(sum(score), 9), round(max(score), 12) FROM composition GROUP BY ALL",
    "calibration": "SELECT model, count(*), round(sum(p_value), 9) FROM calibration GROUP BY ALL",
    "discoveries": "SELECT count(*) FROM discoveries",
    "head_scores": "SELECT model, count(*), round(sum(induction_mean), 9) FROM head_scores GROUP BY ALL",
    "edges": "SELECT model, count(*) FROM edge_attribution GROUP BY ALL",
    "models": "SELECT model, weights_sha256 FROM models",
    "excluded": "SELECT count(*) FROM excluded_shards",
}


@pytest.fixture(scope="module", autouse=True)
def only_when_asked(request):
    """Minutes of Snakemake runs: out of the default suite (skipped, saying how to run them)."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the pipeline fault suite takes minutes on 2 cores: pytest -m slow tests/test_faults_pipeline.py")


def snakemake(work: Path, *extra: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    cfg = work / "config.yaml"
    cfg.write_text(yaml.safe_dump(CONFIG))
    proc = subprocess.run([*SNAKEMAKE, "--directory", str(work), "--configfile", str(cfg), *extra], capture_output=True,
                          text=True, timeout=600 * machine_slowdown(), **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def numbers(work: Path) -> dict[str, list]:
    db = work / "results" / "atlas.duckdb"
    return {k: sorted(query(db, sql).rows()) for k, sql in NUMBERS.items()}


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> tuple[Path, dict]:
    work = tmp_path_factory.mktemp("clean")
    snakemake(work)
    return work, numbers(work)


def copy_of(clean: tuple[Path, dict], tmp_path: Path) -> Path:
    work = tmp_path / "w"
    shutil.copytree(clean[0], work, symlinks=True)  # .snakemake's metadata and every mtime kept
    return work


def shard(work: Path, block: int = 1) -> Path:
    return (work / "results" / "composition" / "model=toy-gpt2" / "checkpoint=final" / "metric=frobenius"
            / "space=residual" / f"block={block}.parquet")


def test_kill_9_at_each_rule_then_the_rerun_gives_the_clean_numbers(clean, tmp_path):
    """Each round starts Snakemake, waits for the first job of a rule not yet killed (its log
    appears) and kills the whole process group (Snakemake and its jobs) with SIGKILL; then the
    advice Snakemake prints (--unlock, --rerun-incomplete) is followed. The last run completes."""
    work, killed = tmp_path / "k", []
    work.mkdir()
    cfg = work / "config.yaml"
    cfg.write_text(yaml.safe_dump(CONFIG))
    logs = work / "results" / "logs"
    cmd = [*SNAKEMAKE, "--directory", str(work), "--configfile", str(cfg), "--rerun-incomplete"]
    deadline = time.monotonic() + 900 * machine_slowdown()
    while time.monotonic() < deadline:
        seen = {p for p in logs.rglob("*.log")} if logs.exists() else set()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        victim = None
        while proc.poll() is None and victim is None:
            new = {p for p in logs.rglob("*.log")} - seen if logs.exists() else set()
            rules = {p.relative_to(logs).parts[0].removesuffix(".log") for p in new} - set(killed)
            if rules:
                victim = sorted(rules)[0]
                os.killpg(proc.pid, signal.SIGKILL)
            time.sleep(0.05)
        err = proc.communicate()[1]
        if victim is None:
            assert proc.returncode == 0, err[-3000:]
            break
        killed.append(victim)
        subprocess.run([*cmd, "--unlock"], capture_output=True, timeout=300)  # Snakemake's advice after a kill
    print(f"killed at: {', '.join(killed)}; then completed")
    assert {"extract", "composition", "calibrate", "induction", "atlas", "report"} <= set(killed), killed
    assert numbers(work) == clean[1]
    assert not list((work / "results").rglob(".*.tmp"))  # left by the kills, removed by the runs after
    assert not bad_shards((work / "results").rglob("*.parquet"))


@pytest.mark.parametrize("fault", ["truncate", "flip"])
def test_a_bad_composition_shard_is_named_and_the_advice_recovers(clean, tmp_path, fault):
    work = copy_of(clean, tmp_path)
    bad = shard(work)
    data = bytearray(bad.read_bytes())
    if fault == "truncate":
        os.truncate(bad, 500)
    else:
        data[len(data) // 3] ^= 0x40  # a byte in the column data: the footer still opens
        bad.write_bytes(bytes(data))
    proc = snakemake(work, check=False)
    assert proc.returncode != 0
    log = (work / "results" / "logs" / "calibrate" / "toy-gpt2" / "final.log").read_text()
    line = next(s for s in log.splitlines() if "BadShard" in s)
    assert f"result shard {bad.relative_to(work)} is corrupt or truncated" in line and "set aside as" in line
    assert line.endswith("rerun snakemake to remake it")
    # meanwhile the atlas answers, without the model whose calibration Snakemake removed
    got = query(work / "results" / "atlas.duckdb", "SELECT DISTINCT model FROM calibration")
    assert got.rows() == [("toy-llama",)]
    snakemake(work)  # the advice
    assert numbers(work) == clean[1]


def test_bit_rot_snakemake_cannot_see_is_found_by_check_shards_whose_advice_recovers(clean, tmp_path):
    """A byte flipped with the shard's mtime kept (rot on the disk): Snakemake sees nothing to do
    and a connection trusts the unchanged size and mtime; `compatlas check-shards` names it, and
    its advice (--set-aside, then snakemake) gives the clean numbers."""
    work = copy_of(clean, tmp_path)
    bad = shard(work, block=0)
    st = bad.stat()
    data = bytearray(bad.read_bytes())
    data[len(data) // 3] ^= 0x01
    bad.write_bytes(bytes(data))
    os.utime(bad, ns=(st.st_atime_ns, st.st_mtime_ns))
    cli = [sys.executable, "-m", "compatlas.cli", "check-shards", "results"]
    proc = subprocess.run(cli, cwd=work, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert str(bad.relative_to(work)) in proc.stderr and "content does not match its checksum" in proc.stderr
    assert "compatlas check-shards --set-aside results, then rerun snakemake" in proc.stderr
    proc = subprocess.run([*cli[:-1], "--set-aside", "results"], cwd=work, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "set aside as" in proc.stderr and not bad.exists()
    snakemake(work)
    assert numbers(work) == clean[1]
    assert subprocess.run(cli, cwd=work, capture_output=True, text=True, timeout=300).returncode == 0


def test_a_truncated_head_score_shard_is_left_out_said_in_the_report_and_remade(clean, tmp_path):
    work = copy_of(clean, tmp_path)
    heads = work / "results" / "induction" / "model=toy-gpt2" / "checkpoint=final" / "heads.parquet"
    os.truncate(heads, 300)
    snakemake(work)  # exits 0: the atlas leaves it out
    db = work / "results" / "atlas.duckdb"
    assert query(db, "SELECT view, path FROM excluded_shards").rows() == [("head_scores", str(heads.relative_to(work)))]
    assert query(db, "SELECT DISTINCT model FROM head_scores").rows() == [("toy-llama",)]
    report = work / "results" / "report"
    for page in ("index.html", "model-toy-gpt2.html"):
        text = (report / page).read_text(encoding="utf-8")
        assert "Incomplete: 1 result shard left out of this atlas" in text and "head scores and ablation" in text
    assert "Incomplete" not in (report / "model-toy-llama.html").read_text(encoding="utf-8")
    snakemake(work)  # the next run remakes it
    assert numbers(work) == clean[1]
    assert "Incomplete" not in (report / "index.html").read_text(encoding="utf-8")


def test_a_crashed_read_write_sessions_wal_never_reaches_a_rebuilt_atlas(clean, tmp_path):
    work = copy_of(clean, tmp_path)
    db = work / "results" / "atlas.duckdb"
    code = (f"import os, signal, duckdb\ncon = duckdb.connect({str(db)!r})\n"
            "con.execute(\"DELETE FROM models WHERE model = 'toy-gpt2'; DROP VIEW discoveries\")\n"
            "os.kill(os.getpid(), signal.SIGKILL)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == -signal.SIGKILL
    assert wal_path(db).exists()
    assert numbers(work) == clean[1]  # compatlas never reads the WAL
    proc = snakemake(work)  # the advice: the WAL makes the atlas be rebuilt, and the rebuild moves it aside
    assert "was written to by a read-write session: rebuilding it" in proc.stderr
    assert not wal_path(db).exists() and list((work / "results" / SESSIONS).glob("*/atlas.duckdb.wal"))
    assert numbers(work) == clean[1]
    snakemake(work, "--forcerun", "atlas")  # and every rebuild after it
    assert numbers(work) == clean[1]


def test_two_runs_at_once_one_waits_its_turn(clean, tmp_path):
    work, other = tmp_path / "a", tmp_path / "b"
    work.mkdir()
    other.mkdir()
    cfg = work / "config.yaml"
    cfg.write_text(yaml.safe_dump(CONFIG))
    first = subprocess.Popen([*SNAKEMAKE, "--directory", str(work), "--configfile", str(cfg)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lock = work / "results" / ".compatlas-run.lock"
    for _ in range(600):
        if lock.exists() or first.poll() is not None:
            break
        time.sleep(0.1)
    assert lock.exists()
    second = dict(CONFIG, results=str(work / "results"))  # another folder, the same results
    (other / "config.yaml").write_text(yaml.safe_dump(second))
    proc = subprocess.run([*SNAKEMAKE, "--directory", str(other), "--configfile", str(other / "config.yaml")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "is in use by another run" in proc.stderr
    assert first.wait(600 * machine_slowdown()) == 0, first.stderr.read()[-3000:]
    assert numbers(work) == clean[1]


def test_a_full_disk_names_the_file_and_the_rerun_after_freeing_space_completes(clean, tmp_path):
    work = tmp_path / "d"
    (work / "results").mkdir(parents=True)
    mnt = work / "results"
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        proc = snakemake(work, "--keep-going", check=False)
        assert proc.returncode != 0
        logs = "\n".join(p.read_text() for p in (mnt / "logs").rglob("*.log"))
        line = next(s for s in (logs + proc.stderr).splitlines() if "no space left on device writing" in s)
        assert str(mnt) in line or "results/" in line, line
        assert "MB free in" in line
        assert not bad_shards(mnt.rglob("*.parquet"))  # whatever was written is whole
        subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True)
        snakemake(work)
        assert numbers(work) == clean[1]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid`` (/proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def test_a_killed_job_server_leaves_no_writer_and_the_rerun_gives_its_own_numbers(tmp_path):
    """kill -9 of the job server while toy-gpt2's edge attribution ran: Snakemake failed, but the
    job's fork ran on and sealed its 512-sequence edges.parquet over the rerun's 64-sequence one,
    with exit 0 after. Now the fork dies with its server, and the rerun's shard stays its own
    (without the fork's death, it runs on for a minute here)."""
    if not Path("/proc/self/stat").exists():
        pytest.skip("finds the server's forks in /proc")
    work = tmp_path / "s"
    work.mkdir()
    target = "results/edge_attribution/model=toy-gpt2/checkpoint=final/edges.parquet"
    config = dict(CONFIG, models={"toy-gpt2": CONFIG["models"]["toy-gpt2"]})
    # a minute's work for the toy (4 s at 512 sequences): a fork left running would be seen to
    config["induction"] = dict(CONFIG["induction"], edge_attribution={"sequences": 8192})
    cfg = work / "config.yaml"
    cfg.write_text(yaml.safe_dump(config))
    # stderr to a file, not a pipe: a fork left holding the pipe would hold up reading it to the end
    stderr = (tmp_path / "first.err").open("w")
    proc = subprocess.Popen([*SNAKEMAKE, target, "--directory", str(work), "--configfile", str(cfg)],
                            stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
    log = work / "results" / "logs" / "edge_attribution"
    forks: list[int] = []
    deadline = time.monotonic() + 600 * machine_slowdown()
    while not forks:
        assert proc.poll() is None and time.monotonic() < deadline, "the edge attribution job never started"
        if log.exists() and any(log.rglob("*.log")):
            servers = [c for c in children(proc.pid) if b"compatlas.worker.server" in Path(f"/proc/{c}/cmdline").read_bytes()]
            forks = [f for s in servers for f in children(s)]
            if forks:
                for s in servers:
                    os.kill(s, signal.SIGKILL)
        time.sleep(0.05)
    proc.wait(300 * machine_slowdown())
    stderr.close()
    err = (tmp_path / "first.err").read_text()
    assert proc.returncode != 0 and "went away before the job ended" in err, err[-3000:]
    gone = time.monotonic() + 10 * machine_slowdown()
    while any(Path(f"/proc/{f}").exists() and "Z" != Path(f"/proc/{f}/stat").read_text().rsplit(")", 1)[1].split()[0]
              for f in forks):
        assert time.monotonic() < gone, "the job's fork outlived its server"
        time.sleep(0.05)
    config["induction"]["edge_attribution"]["sequences"] = 64  # the rerun, at once, with another config
    cfg.write_text(yaml.safe_dump(config))
    rerun = subprocess.run([*SNAKEMAKE, target, "--directory", str(work), "--configfile", str(cfg)],
                           capture_output=True, text=True, timeout=600 * machine_slowdown())
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    import polars as pl

    edges = work / target
    assert set(pl.read_parquet(edges)["n_sequences"]) == {64} and not bad_shards([edges])
    time.sleep(10)  # a fork left running would write at any time: none is
    assert set(pl.read_parquet(edges)["n_sequences"]) == {64} and not bad_shards([edges])
