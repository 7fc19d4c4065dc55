"""The behaviour jobs' float32 products in oneDNN against torch's BLAS (``induction.cpu_matmul``).

Part 1, the products: one core's rate on the shapes SmolLM2's jobs multiply (its MLP, attention
projections, the per-head Q/K/V products of the split inputs, the unembedding, EAP's scoring
product), in torch's BLAS (MKL), in oneDNN as ``compatlas.models.cpu_matmul`` calls it, and, for the
machine's limit, numpy's OpenBLAS on the same shape (which takes this CPU's widest kernels).

Part 2, the jobs: jobs of a finished default run rerun with ``snakemake --cores 1 -f`` in the run's
job server, as the run runs them, alternately with ``cpu_matmul: blas`` and ``onednn`` (passed with
``--config``; ``--rerun-triggers mtime`` so that only the target reruns): wall seconds, and how far
the shard's numbers moved (the largest difference of each float column against its largest value).
Each target is left as ``onednn`` (the default) wrote it, rerun last.

    python benchmarks/bench_cpu_matmul.py [DIR] [--targets exact,eap,induction] [--pairs 1]

DIR: a checkout whose default run has finished (README command 1); without it, part 1 only.
Ratios are blas / onednn from the same machine in the same minutes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's OpenBLAS on one core, read when numpy loads

import numpy as np
import polars as pl
import torch

from compatlas.models import cpu_matmul as cm
from compatlas.models.cpu_matmul import cpu_matmul

TARGETS = {
    "exact": "results/exact_values/model=smollm2-135m/checkpoint=final/share=0.parquet",
    "eap": "results/edge_sums/model=smollm2-135m/checkpoint=final/share=0.parquet",
    "induction": "results/induction/model=smollm2-135m/checkpoint=final/heads.parquet",
}
# (what, m, k, n): rows x inner x columns of SmolLM2-135M's products in an EAP batch of 8
# sequences of 41 tokens (320 rows; 8 x 40 x 9 = 2880 for the per-head split inputs)
SHAPES = [
    ("MLP up / gate", 320, 576, 1536),
    ("MLP down", 320, 1536, 576),
    ("W_Q / W_O", 320, 576, 576),
    ("W_K / W_V (3 KV heads)", 320, 576, 192),
    ("split input x W_Q[h]", 320, 576, 64),
    ("unembedding (19 positions x 8)", 152, 576, 49152),
    ("its gradient", 152, 49152, 576),
    ("EAP scoring (30 readers)", 30, 23616, 270),
    ("attention scores (stays in BLAS)", 40, 64, 40),
    ("below ONEDNN_MIN_WORK", 64, 64, 64),
    ("near ONEDNN_MIN_WORK", 128, 64, 128),
]


def rate(fn, flops: float, seconds: float = 0.5) -> float:
    """GFLOP/s of ``fn``: repeated for about ``seconds`` after one warm-up call."""
    fn()
    reps, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        fn()
        reps += 1
    return flops * reps / elapsed / 1e9


def products() -> None:
    torch.set_num_threads(1)
    print(f"{'product':36s} {'m x k x n':>20s} {'BLAS':>7s} {'oneDNN':>7s} {'OpenBLAS':>9s}  oneDNN/BLAS  (GFLOP/s, one core)")
    for what, m, k, n in SHAPES:
        a, b = torch.randn(m, k), torch.randn(k, n)
        an, bn = a.numpy(), b.numpy()
        flops = 2.0 * m * k * n
        blas = rate(lambda: a @ b, flops)
        with cpu_matmul("onednn"), mock.patch.object(cm, "ONEDNN_MIN_WORK", 0):  # every shape routed, to compare
            onednn = rate(lambda: a @ b, flops)
        openblas = rate(lambda: an @ bn, flops)
        print(f"{what:36s} {f'{m} x {k} x {n}':>20s} {blas:7.1f} {onednn:7.1f} {openblas:9.1f}  {onednn / blas:.2f}", flush=True)


def rerun(run: Path, target: str, kind: str) -> tuple[float, pl.DataFrame]:
    t0 = time.perf_counter()
    subprocess.run([".venv/bin/snakemake", "--cores", "1", "--quiet", "--rerun-triggers", "mtime", "-f", target,
                    "--configfile", "config/config.yaml", "--config", f"induction={{cpu_matmul: {kind}}}"],
                   cwd=run, check=True, capture_output=True)
    return time.perf_counter() - t0, pl.read_parquet(run / target)


def moved(a: pl.DataFrame, b: pl.DataFrame) -> str:
    """The largest difference of each float column, against the column's largest |value|."""
    out = []
    for name, dtype in a.schema.items():
        if dtype.is_float():
            x, y = a[name].to_numpy(), b[name].to_numpy()
            top = np.nanmax(np.abs(x)) if np.isfinite(x).any() else 0.0
            diff = np.nanmax(np.abs(x - y)) if np.isfinite(x - y).any() else 0.0
            out.append(f"{name} {diff:.1e} of {top:.2g}")
    return ", ".join(out)


def jobs(run: Path, targets: list[str], pairs: int) -> None:
    for name in targets:
        target = TARGETS[name]
        times: dict[str, list[float]] = {"blas": [], "onednn": []}
        frames = {}
        for _ in range(pairs):
            for kind in ("blas", "onednn"):
                seconds, frames[kind] = rerun(run, target, kind)
                times[kind].append(seconds)
                print(f"{name:10s} {kind:7s} {seconds:7.1f} s", flush=True)
        blas, onednn = (sum(times[k]) / pairs for k in ("blas", "onednn"))
        print(f"{name}: blas / onednn {blas / onednn:.2f} ({blas:.1f} s against {onednn:.1f} s); moved: "
              f"{moved(frames['blas'], frames['onednn'])}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, nargs="?", help="a checkout whose default run has finished")
    p.add_argument("--targets", default="exact,eap,induction", help=f"of {', '.join(TARGETS)}")
    p.add_argument("--pairs", type=int, default=1)
    args = p.parse_args()
    products()
    if args.run:
        jobs(args.run, args.targets.split(","), args.pairs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
