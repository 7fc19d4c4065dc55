"""What sealing and verifying shards costs (compatlas.storage: a sha256 beside every shard).

Writes synthetic composition shards (random scores and baselines: incompressible, as real ones
are) with ``write_shard``, sealed and with its checksum patched out, then times, per GB on disk:
sealing (the write's extra pass), verifying every shard as the atlas build and check-shards
do (``shard_error``, file cache warm), and a connection's check of what changed since the build
(a stat per shard). Extrapolated to the 70B benchmark atlas (benchmarks/bench_report_70b.py:
8.6 GB in 713 shards), which takes 15 min to build and was not rebuilt for this.

    .venv/bin/python benchmarks/bench_integrity.py [--gb 1.0] [--shards 40]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np
import polars as pl

from compatlas import storage
from compatlas.atlas import build_atlas, connect
from compatlas.storage import bad_shards, write_shard

ATLAS_70B_GB, ATLAS_70B_SHARDS = 8.6, 713


def frame(rows: int, rng: np.random.Generator) -> pl.DataFrame:
    return pl.DataFrame({
        "model": "synthetic", "checkpoint": "final", "processing": "none", "space": "residual", "metric": "frobenius",
        "comp": rng.choice(["Q", "K", "V"], rows), "writer_layer": rng.integers(0, 80, rows, dtype=np.int32),
        "writer_head": rng.integers(0, 64, rows, dtype=np.int32), "reader_layer": rng.integers(0, 80, rows, dtype=np.int32),
        "reader_head": rng.integers(0, 64, rows, dtype=np.int32), "score": rng.random(rows),
        "baseline_gaussian_mean": rng.random(rows), "baseline_gaussian_std": rng.random(rows),
        "baseline_spectrum_mean": rng.random(rows), "baseline_spectrum_std": rng.random(rows)})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--shards", type=int, default=40)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = int(args.gb * 1e9 / 41 / args.shards)  # about 41 bytes a row on disk (printed below)
    df = frame(rows, rng)
    root = Path(tempfile.mkdtemp(prefix="compatlas-integrity-"))
    try:
        unsealed, sealed = root / "unsealed", root / "results" / "composition"
        paths = [sealed / f"block={i}.parquet" for i in range(args.shards)]
        t_plain = t_sealed = 0.0
        for i, p in enumerate(paths):  # interleaved, so that other work on the machine falls on both alike
            t0 = time.perf_counter()
            with mock.patch.object(storage, "seal", lambda tmp, path: None):  # the same atomic write, no checksum
                write_shard(df, unsealed / f"block={i}.parquet", {})
            t_plain += time.perf_counter() - t0
            t0 = time.perf_counter()
            write_shard(df, p, {})
            t_sealed += time.perf_counter() - t0
        gb = sum(p.stat().st_size for p in paths) / 1e9
        t0 = time.perf_counter()
        assert not bad_shards(paths)
        t_verify = time.perf_counter() - t0
        db = root / "results" / "atlas.duckdb"
        t0 = time.perf_counter()
        build_atlas(db, {"composition": paths}, [])
        t_build = time.perf_counter() - t0
        connects = {}
        for n in (1, args.shards):  # a connection's fixed cost, and its cost per shard (a stat each)
            build_atlas(db, {"composition": paths[:n]}, [])
            t0 = time.perf_counter()
            for _ in range(5):
                connect(db).close()
            connects[n] = (time.perf_counter() - t0) / 5
        per_shard = (connects[args.shards] - connects[1]) / (args.shards - 1)
        print(f"{args.shards} shards, {gb:.2f} GB on disk, {rows * args.shards / 1e6:.0f}M rows "
              f"({gb * 1e9 / rows / args.shards:.0f} bytes a row)")
        print(f"write_shard without its checksum: {t_plain:.2f} s; sealed: {t_sealed:.2f} s: sealing adds "
              f"{(t_sealed - t_plain) / gb:.2f} s per GB ({100 * (t_sealed - t_plain) / t_plain:.0f}% of the write)")
        print(f"verify every shard (sha256 + footer): {t_verify:.2f} s = {t_verify / gb:.2f} s per GB")
        print(f"build_atlas (verifies every shard): {t_build:.2f} s; a connection: {connects[1] * 1e3:.0f} ms with 1 "
              f"shard, {connects[args.shards] * 1e3:.0f} ms with {args.shards} ({per_shard * 1e3:.2f} ms a shard)")
        print(f"the 70B benchmark atlas ({ATLAS_70B_GB} GB, {ATLAS_70B_SHARDS} shards), extrapolated: sealing "
              f"{ATLAS_70B_GB * (t_sealed - t_plain) / gb:.0f} s over all its writes; verifying "
              f"{ATLAS_70B_GB * t_verify / gb:.0f} s at each build and check-shards; a connection "
              f"{(connects[1] + per_shard * (ATLAS_70B_SHARDS - 1)) * 1e3:.0f} ms")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
