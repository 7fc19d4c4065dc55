"""One job of a finished run, rerun with glibc's default allocator and with the run's own
(``compatlas.runtime.JOB_MALLOC``), alternately: wall and system seconds, page faults, peak memory,
and whether its shard came out with the same rows (its provenance records timings, which differ).

    python benchmarks/bench_allocator.py DIR [--target PATH] [--pairs 2]

DIR is a checkout whose default run has finished (README command 1); ``--target`` one of its
outputs, rerun with ``snakemake --cores 1 -f`` in the run's job server as the run runs it (default:
SmolLM2's first exact-patching share, a 2-minute job). "default" passes an empty
``GLIBC_TUNABLES`` (the run then leaves glibc's own settings), "run" leaves it unset (the run sets
JOB_MALLOC). Ratios are run / default, from the same machine in the same minutes.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import polars as pl

EXACT_SHARE = "results/exact_values/model=smollm2-135m/checkpoint=final/share=0.parquet"
STAT = re.compile(r"([\d,]+)\s+(page-faults|task-clock)")


def rerun(run: Path, target: str, tunables: str | None) -> dict[str, float]:
    """The job's wall, system and CPU seconds, page faults and peak memory, from ``perf stat``
    and GNU time around its Snakemake (the job server included, as in a run)."""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    out = subprocess.run(["perf", "stat", "-x,", "-e", "page-faults", "/usr/bin/time", "-f", "%e %S %U %M",
                          ".venv/bin/snakemake", "--cores", "1", "--quiet", "-f", target],
                         cwd=run, env=env, capture_output=True, text=True, check=True)
    lines = out.stderr.strip().splitlines()
    faults = next(int(line.split(",")[0]) for line in lines if line.endswith("page-faults") or ",page-faults" in line)
    wall, system, user, peak_kb = next(line for line in lines if re.fullmatch(r"[\d.]+ [\d.]+ [\d.]+ \d+", line)).split()
    return {"wall_s": float(wall), "sys_s": float(system), "user_s": float(user), "page_faults": faults,
            "peak_gb": int(peak_kb) / 1e6, "rows": pl.read_parquet(run / target)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, help="a checkout whose default run has finished")
    p.add_argument("--target", default=EXACT_SHARE)
    p.add_argument("--pairs", type=int, default=2)
    args = p.parse_args()
    rows = []
    for _ in range(args.pairs):
        for name, tunables in (("default", ""), ("run", None)):
            r = rerun(args.run, args.target, tunables)
            rows.append((name, r))
            print(f"{name:8s} wall {r['wall_s']:7.1f} s  sys {r['sys_s']:5.1f} s  user {r['user_s']:7.1f} s  "
                  f"page faults {r['page_faults']:>10,}  peak {r['peak_gb']:.2f} GB", flush=True)
    mean = {n: {k: sum(r[k] for m, r in rows if m == n) / args.pairs for k in ("wall_s", "sys_s", "page_faults")}
            for n in ("default", "run")}
    print("run / default: " + "  ".join(f"{k} {mean['run'][k] / mean['default'][k]:.3f}" for k in mean["run"]))
    same = all(r["rows"].equals(rows[0][1]["rows"]) for _, r in rows)
    print("the shard: " + ("the same rows every time" if same else "its rows DIFFER between reruns"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
