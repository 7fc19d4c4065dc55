"""Where a run's time and memory go, rule by rule: jobs, start-up against work, peak memory, and the total.

    python benchmarks/bench_default_run.py --run DIR      # README command 1's run in DIR (a clone), timed, then read
    python benchmarks/bench_default_run.py [WORKDIR]      # read a finished run (its jobs' logs under results/logs)

Every job logs to ``results/logs/<rule>/...`` (compatlas.logs): its start-up (``job start-up X s``,
from the job's process start to its script's first line), then its work until its last line, and
on exit its peak resident memory (``peak resident memory X MB``; a fork of the job server counts
the server's pages it shares, as the kernel's maximum resident set does). Per rule it prints the
jobs, their start-up and work summed over jobs, the longest job and the largest job's peak memory.
The jobs' work summed is set beside the span from the first job's first line to the last job's
last line: on 2 cores, a run of W seconds has 2 W core-seconds to fill. The logs are read, not
Snakemake's own (which ``--quiet rules``, as CI runs it, leaves without the jobs), so any finished
run can be read.

``--run DIR`` runs ``snakemake --cores 2`` in DIR (which must hold a checkout with its .venv; the
results folder is removed first) and reports its wall clock beside the table; bench_default_run_parts.py
holds the earlier micro-benchmarks of its pieces.

It ends with this machine's speed, measured in the same run: one core's float32 matrix product
at the shape of SmolLM2's MLP on a batch of its edge attribution (1312 x 576 @ 576 x 1536) in
torch's BLAS (what composition and training multiply in) and in oneDNN (the behaviour jobs' products,
``induction.cpu_matmul``), the rates the run's largest jobs are bound by. The same machine has
measured 80 to 150 GFLOP/s in torch's BLAS on different days: compare runs by their work against
these rates, not across days by seconds.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from compatlas.vocab import CpuMatmul

LINE_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
START_UP = re.compile(r"job start-up ([\d.]+)s")
PEAK = re.compile(r"peak resident memory (\d+) MB")


@dataclass
class Job:
    rule: str
    log: Path
    first: float  # the job's first and last log lines (epoch seconds)
    last: float
    start_up: float = 0.0  # seconds, from the job's log (0: the log does not say)
    peak_mb: int | None = None

    @property
    def work(self) -> float:
        return self.last - self.first


def read_job(rule: str, log: Path) -> Job | None:
    times, start_up, peak = [], 0.0, None
    for line in log.read_text(errors="replace").splitlines():
        if m := LINE_TIME.match(line):
            times.append(datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp())
        if not start_up and (s := START_UP.search(line)):
            start_up = float(s[1])
        if p := PEAK.search(line):
            peak = int(p[1])
    return Job(rule, log, times[0], times[-1], start_up, peak) if times else None


def read_jobs(logs: Path) -> list[Job]:
    """Every job of the run whose logs are under ``logs``: the rule is the first folder (or the
    file's name, for a rule of one job)."""
    jobs = []
    for log in sorted(logs.rglob("*.log")):
        rel = log.relative_to(logs)
        rule = rel.parts[0].removesuffix(".log")
        if rule == "compatlas-worker":  # the job server's own log, not a job
            continue
        if (job := read_job(rule, log)) is not None:
            jobs.append(job)
    return jobs


def report(workdir: Path, wall: float | None = None) -> None:
    logs = workdir / "results" / "logs"
    jobs = read_jobs(logs)
    if not jobs:
        raise SystemExit(f"{logs}: no job logs")
    by_rule: dict[str, list[Job]] = defaultdict(list)
    for j in jobs:
        by_rule[j.rule].append(j)
    print(f"run: {logs}")
    print("| rule | jobs | work (job-s) | start-up (job-s) | longest job (s) | peak memory (GB, largest job) |")
    print("|---|---|---|---|---|---|")
    for rule, js in sorted(by_rule.items(), key=lambda kv: -sum(j.work for j in kv[1])):
        longest = max(js, key=lambda j: j.work)
        peaks = [j.peak_mb for j in js if j.peak_mb is not None]
        peak = f"{max(peaks) / 1024:.2f}" if peaks else "-"
        print(f"| {rule} | {len(js)} | {sum(j.work for j in js):.0f} | {sum(j.start_up for j in js):.1f} | "
              f"{longest.work:.0f} ({longest.log.relative_to(logs).with_suffix('')}) | {peak} |")
    work = sum(j.work for j in jobs)
    span = max(j.last for j in jobs) - min(j.first for j in jobs)
    peaks = [j.peak_mb for j in jobs if j.peak_mb is not None]
    print(f"| total | {len(jobs)} | {work:.0f} | {sum(j.start_up for j in jobs):.1f} | | "
          f"{f'{max(peaks) / 1024:.2f}' if peaks else '-'} |")
    print(f"first job's first line to last job's last line: {span:.0f} s ({span / 60:.1f} min); "
          f"work summed {work:.0f} s = {work / max(span, 1):.2f} cores busy on average")
    if wall is not None:
        print(f"the run's wall clock (snakemake, from its start): {wall:.0f} s ({wall / 60:.1f} min)")


def matmul_rate(m: int = 1312, k: int = 576, n: int = 1536, repeats: int = 30, kind: CpuMatmul = "blas") -> float:
    """GFLOP/s of one core's float32 ``x @ w.T`` ([m, k] x [n, k]), the best of ``repeats``, in
    torch's BLAS or oneDNN (``kind``, as ``compatlas.models.cpu_matmul`` routes a job's products)."""
    import torch

    from compatlas.models.cpu_matmul import cpu_matmul

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x, w = torch.randn(m, k), torch.randn(n, k)
        with cpu_matmul(kind):
            for _ in range(3):
                torch.nn.functional.linear(x, w)
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                torch.nn.functional.linear(x, w)
                best = min(best, time.perf_counter() - t0)
        return 2 * m * k * n / best / 1e9
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workdir", nargs="?", default=".", type=Path, help="a finished run's working directory")
    ap.add_argument("--run", type=Path, help="run README command 1's snakemake in this checkout first (results removed)")
    ap.add_argument("--cores", type=int, default=2)
    args = ap.parse_args()
    wall = None
    workdir = args.workdir
    if args.run is not None:
        workdir = args.run
        shutil.rmtree(workdir / "results", ignore_errors=True)
        t0 = time.perf_counter()
        subprocess.run([str(workdir / ".venv" / "bin" / "snakemake"), "--cores", str(args.cores)], cwd=workdir, check=True,
                       stdout=subprocess.DEVNULL, stderr=sys.stderr)
        wall = time.perf_counter() - t0
    report(workdir.resolve(), wall)
    print(f"this machine now: one core's float32 matrix product (1312 x 576 @ 576 x 1536) {matmul_rate():.0f} GFLOP/s "
          f"in torch's BLAS, {matmul_rate(kind='onednn'):.0f} in oneDNN (the behaviour jobs')")


if __name__ == "__main__":
    main()
