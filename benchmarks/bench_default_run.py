"""Where a run's time goes, rule by rule: jobs, start-up against work, and the total.

    python benchmarks/bench_default_run.py --run DIR      # README command 1's run in DIR (a clone), timed, then read
    python benchmarks/bench_default_run.py [WORKDIR]      # read a finished run (its newest Snakemake log)

For every job it reads Snakemake's log (when the job started and finished, to the second) and the
job's own log (compatlas.logs: ``job start-up X s``, from the job's process start to its script's
first line, then its work until the last line). Per rule it prints the jobs, their wall time
(the sum over jobs), start-up, work, and the rest (teardown, Snakemake's own bookkeeping, the
one-second rounding of its log). A job whose log has no start-up line (a checkout from before
it) counts its whole wall time as "unsplit". The cores' sum over jobs is set beside the run's
wall clock: on 2 cores, a run of W seconds has 2 W core-seconds to fill.

``--run DIR`` runs ``snakemake --cores 2`` in DIR (which must hold a checkout with its .venv; the
results folder is removed first) and reports its wall clock beside the table; bench_default_run_parts.py
holds the earlier micro-benchmarks of its pieces.
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

STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
LINE_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
START_UP = re.compile(r"job start-up ([\d.]+)s")


@dataclass
class Job:
    rule: str
    log: Path | None
    started: float
    finished: float | None = None
    start_up: float | None = None  # seconds, from the job's log (None: the log does not say)
    work: float | None = None


def parse_snakemake_log(path: Path, workdir: Path) -> list[Job]:
    jobs: dict[str, Job] = {}
    stamp = 0.0
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if m := STAMP.match(line.strip()):
            stamp = datetime.strptime(m[1], "%a %b %d %H:%M:%S %Y").timestamp()
            continue
        s = line.strip()
        if s.startswith(("rule ", "localrule ")) and s.endswith(":"):
            rule = s.split(" ", 1)[1].rstrip(":")
            block = []
            for nxt in lines[i + 1:]:
                if not nxt.startswith("    "):
                    break
                block.append(nxt.strip())
            jobid = next((b.split(": ", 1)[1] for b in block if b.startswith("jobid: ")), None)
            log = next((b.split(": ", 1)[1] for b in block if b.startswith("log: ")), None)
            if jobid is not None:
                jobs[jobid] = Job(rule, workdir / log.split(",")[0].strip() if log else None, stamp)
        elif m := re.match(r"Finished jobid: (\d+)", s):
            if m[1] in jobs:
                jobs[m[1]].finished = stamp
    return [j for j in jobs.values() if j.finished is not None]


def read_job_log(job: Job) -> None:
    if job.log is None or not job.log.exists():
        return
    times, start_up = [], None
    for line in job.log.read_text(errors="replace").splitlines():
        if m := LINE_TIME.match(line):
            times.append(datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp())
            if start_up is None and (s := START_UP.search(line)):
                start_up = float(s[1])
    if not times:
        return
    if start_up is not None:
        job.work, job.start_up = times[-1] - times[0], start_up


def report(workdir: Path, wall: float | None = None) -> None:
    logs = sorted((workdir / ".snakemake" / "log").glob("*.snakemake.log"))
    if not logs:
        raise SystemExit(f"{workdir}: no Snakemake log under .snakemake/log")
    jobs = parse_snakemake_log(logs[-1], workdir)
    for j in jobs:
        read_job_log(j)
    by_rule: dict[str, list[Job]] = defaultdict(list)
    for j in jobs:
        by_rule[j.rule].append(j)
    first = min(j.started for j in jobs)
    last = max(j.finished or j.started for j in jobs)
    print(f"run: {logs[-1]}")
    print(f"{'rule':<18}{'jobs':>6}{'wall s':>10}{'start-up s':>12}{'work s':>10}{'rest s':>9}{'unsplit s':>11}"
          f"{'start-up/job':>14}")
    totals = [0, 0.0, 0.0, 0.0, 0.0]
    for rule, js in sorted(by_rule.items(), key=lambda kv: -sum((j.finished or 0) - j.started for j in kv[1])):
        split = [j for j in js if j.start_up is not None]
        w = sum((j.finished or j.started) - j.started for j in js)
        ws = sum((j.finished or j.started) - j.started for j in split)
        su, wk = sum(j.start_up or 0.0 for j in split), sum(j.work or 0.0 for j in split)
        per = f"{su / len(split):>14.2f}" if split else f"{'-':>14}"
        print(f"{rule:<18}{len(js):>6}{w:>10.0f}{su:>12.1f}{wk:>10.1f}{ws - su - wk:>9.1f}{w - ws:>11.0f}{per}")
        totals = [totals[0] + len(js), totals[1] + w, totals[2] + su, totals[3] + wk, totals[4] + w - ws]
    n, w, su, wk, un = totals
    print(f"{'total':<18}{n:>6}{w:>10.0f}{su:>12.1f}{wk:>10.1f}{w - un - su - wk:>9.1f}{un:>11.0f}")
    span = last - first
    print(f"first job start to last job end: {span:.0f} s ({span / 60:.1f} min); "
          f"jobs' wall summed: {w:.0f} s = {w / max(span, 1):.2f} cores busy on average")
    if un < w:
        print(f"start-up: {su:.0f} s of the split jobs' {w - un:.0f} s ({su / max(w - un, 1):.0%}); "
              f"work {wk:.0f} s ({wk / max(w - un, 1):.0%})")
    if wall is not None:
        print(f"the run's wall clock (snakemake, from its start): {wall:.0f} s ({wall / 60:.1f} min)")


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


if __name__ == "__main__":
    main()
