#!/usr/bin/env python
"""The report and three queries for one 70B-grid model: a synthetic atlas of 80 layers x 64 heads.

The atlas: one model, one checkpoint, all 27 metric x space x comp cells (12.94M causal head
pairs each, 349M composition rows and as many p/q values), written like the pipeline writes it:
composition shards per metric x space x block (a block = one writer layer: 79 of them) with
``storage.write_shard``, one calibration shard beside them (``storage.write_shard_parts``, a row
group per cell and writer layer), views from ``atlas.build_atlas``. Scores, nulls and p-values
are random; planted: the K-composition of a previous-token head (L0.H1) into the induction heads
of the last third (head 0), and 1 in 10,000 pairs of every cell at the null's floor p = 1/(N+1),
so that every cell has about 1,300 discoveries (Benjamini-Hochberg at q <= 0.05). Built once
under ``--dir`` (8.6 GB of shards, 15 min on the 2 shared cores) and reused while its spec is
unchanged (the database, views only, is rebuilt each run: seconds).

Measured, each in its own child process (peak RSS = the child's ru_maxrss; a watchdog kills a
child past ``--max-rss-gb``):

1. ``build_report`` (pages and, unless ``--no-png``, PNGs): wall time, peak RSS, page sizes;
2. three queries a researcher runs on one model, each on a fresh connection (median of 3):
   the strongest 100 pairs of one cell; one pair's scores and p/q over checkpoints in every
   cell; discoveries per layer distance per cell.

Targets: report <= 120 s, peak RSS <= 4 GB, model page <= 10 MB, each query <= 5 s.

    python benchmarks/bench_report_70b.py [--dir /tmp/atlas-70b] [--layers 80 --heads 64] [--no-png]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

TARGETS = {"report_s": 120.0, "report_rss_gb": 4.0, "page_mb": 10.0, "query_s": 5.0}
MODEL, CHECKPOINT = "grid-70b", "final"
PLANT_RATE = 1e-4  # share of each cell's pairs planted at the null's floor (discoveries)


# ----------------------------------------------------------------------------- the atlas


def _bh(p: np.ndarray) -> np.ndarray:
    order = np.argsort(p, kind="stable")
    q = p[order] * len(p) / np.arange(1, len(p) + 1)
    q = np.minimum.accumulate(q[::-1])[::-1]
    out = np.empty_like(q)
    out[order] = np.minimum(q, 1.0)
    return out


def build(root: Path, L: int, H: int, seed: int = 0) -> Path:
    """Write the synthetic atlas under ``root`` (or reuse it: ``root/spec.json`` says what it holds)."""
    import polars as pl

    from compatlas.atlas import build_atlas
    from compatlas.storage import write_shard, write_shard_parts
    from compatlas.tables import CALIBRATION_SCHEMA, COMPOSITION_SCHEMA, HEAD_SCORES_SCHEMA
    from compatlas.vocab import COMPS, METRICS, SPACES

    spec = {"model": MODEL, "n_layers": L, "n_heads": H, "seed": seed, "plant_rate": PLANT_RATE, "version": 2}
    db = root / "atlas.duckdb"
    if db.exists() and (root / "spec.json").exists() and json.loads((root / "spec.json").read_text()) == spec:
        # the shards are reused; the database is rebuilt so its views are this code's
        build_atlas(db, {v: sorted((root / v).rglob("*.parquet")) for v in ("composition", "calibration", "head_scores")},
                    sorted((root / "meta").glob("*.json")))
        return db
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    wl, rl = np.triu_indices(L, 1)
    n_lp = len(wl)
    wl, rl = np.repeat(wl, H * H).astype(np.int32), np.repeat(rl, H * H).astype(np.int32)
    wh = np.tile(np.repeat(np.arange(H, dtype=np.int32), H), n_lp)
    rh = np.tile(np.tile(np.arange(H, dtype=np.int32), H), n_lp)
    n = len(wl)
    n_null = 2 * n  # the mirror and same-layer pairs (about as many as the causal ones)
    floor = 1.0 / (n_null + 1)
    starts = np.searchsorted(wl, np.arange(L))  # rows of writer layer l: starts[l]:starts[l + 1]
    starts = np.append(starts, n)
    induction = (wl == 0) & (wh == 1) & (rl >= (2 * L) // 3) & (rh == 0)
    prov = {"synthetic": True, "bench": "bench_report_70b", **spec}
    comp_paths: list[Path] = []
    t0 = time.perf_counter()

    def cells():
        for metric in METRICS:
            for space in SPACES:
                score, mean, p = {}, {}, {}
                for c in COMPS:
                    s = rng.uniform(0.05, 0.3, n)
                    pv = rng.uniform(0.0, 1.0, n)
                    planted = rng.random(n) < PLANT_RATE
                    if c == "K":
                        planted |= induction
                    s[planted] = rng.uniform(0.5, 0.9, int(planted.sum()))
                    pv[planted] = floor
                    score[c], mean[c], p[c] = s, rng.uniform(0.1, 0.15, n), pv
                keys = {"model": MODEL, "checkpoint": CHECKPOINT, "processing": "none", "space": space, "metric": metric}
                for layer in range(L - 1):  # composition: one shard per block (writer layer), all comps
                    a, b = starts[layer], starts[layer + 1]
                    df = pl.concat([pl.DataFrame({
                        "writer_layer": wl[a:b], "writer_head": wh[a:b], "reader_layer": rl[a:b], "reader_head": rh[a:b],
                        "score": score[c][a:b], "baseline_gaussian_mean": 0.1, "baseline_gaussian_std": 0.02,
                        "baseline_spectrum_mean": mean[c][a:b], "baseline_spectrum_std": 0.03,
                    }).with_columns(pl.lit(c).alias("comp"), *(pl.lit(v).alias(k) for k, v in keys.items())) for c in COMPS])
                    path = (root / "composition" / f"model={MODEL}" / f"checkpoint={CHECKPOINT}" / f"metric={metric}"
                            / f"space={space}" / f"block={layer}.parquet")
                    path.parent.mkdir(parents=True, exist_ok=True)
                    write_shard(df.select(list(COMPOSITION_SCHEMA)).cast(COMPOSITION_SCHEMA), path, prov)  # type: ignore[arg-type]
                    comp_paths.append(path)
                for c in COMPS:  # calibration: a row group per cell and writer layer
                    q = _bh(p[c])
                    for layer in range(L - 1):
                        a, b = starts[layer], starts[layer + 1]
                        yield pl.DataFrame({
                            "writer_layer": wl[a:b], "writer_head": wh[a:b], "reader_layer": rl[a:b], "reader_head": rh[a:b],
                            "reader_kv_head": rh[a:b], "n_null": n_null, "p_value": p[c][a:b], "q_value": q[a:b],
                        }).with_columns(pl.lit(c).alias("comp"), pl.lit("query_head").alias("test_unit"),
                                        *(pl.lit(v).alias(k) for k, v in keys.items()))
                print(f"  {metric} x {space}: written ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)

    cal = root / "calibration" / f"model={MODEL}" / f"checkpoint={CHECKPOINT}" / "pvalues.parquet"
    cal.parent.mkdir(parents=True, exist_ok=True)
    write_shard_parts(cells(), cal, prov, CALIBRATION_SCHEMA)
    layer, head = np.repeat(np.arange(L), H), np.tile(np.arange(H), L)
    heads = pl.DataFrame({"model": MODEL, "checkpoint": CHECKPOINT, "layer": layer, "head": head,
                          "prev_token_mean": np.where((layer == 0) & (head == 1), 0.9, rng.uniform(0, 0.15, L * H)),
                          "prev_token_std": 0.05, "duplicate_mean": rng.uniform(0, 0.2, L * H), "duplicate_std": 0.05,
                          "induction_mean": np.where((layer >= (2 * L) // 3) & (head == 0), 0.9, rng.uniform(0, 0.1, L * H)),
                          "induction_std": 0.05, "n_sequences": 32, "ablation": "zero", "ablation_method": "exact",
                          "ablation_sequences": 16, "ablation_drop": rng.normal(0, 0.02, L * H), "ablation_drop_stderr": 0.02,
                          "clean_strength": 2.0}, schema=HEAD_SCORES_SCHEMA)
    hp = root / "head_scores" / f"{MODEL}__{CHECKPOINT}.parquet"
    hp.parent.mkdir(parents=True)
    write_shard(heads, hp, prov)
    meta = {"model": MODEL, "checkpoint": CHECKPOINT, "checkpoint_step": None, "architecture": "llama",
            "n_layers": L, "n_heads": H, "n_kv_heads": H, "d_model": 8192, "d_head": 128, "d_vocab": 32000,
            "norm_type": "RMS", "processing": "none", "quantized": False, "source_kind": "local",
            "versions": {"torch": "2.13.0"}}
    mp = root / "meta" / f"{MODEL}__{CHECKPOINT}.json"
    mp.parent.mkdir(parents=True)
    mp.write_text(json.dumps(meta))
    build_atlas(db, {"composition": comp_paths, "calibration": [cal], "head_scores": [hp]}, [mp])
    (root / "spec.json").write_text(json.dumps(spec))
    return db


# ----------------------------------------------------------------------------- measured children


QUERIES = {
    "strongest 100 pairs of one cell (frobenius, residual, K)": """
        SELECT writer_layer, writer_head, reader_layer, reader_head, score FROM composition
        WHERE model = '{m}' AND checkpoint = '{c}' AND metric = 'frobenius' AND space = 'residual' AND comp = 'K'
        ORDER BY score DESC LIMIT 100""",
    "one pair's trajectory (every checkpoint and cell, with p and q)": """
        SELECT c.checkpoint, c.metric, c.space, c.comp, c.score, p.p_value, p.q_value
        FROM (SELECT * FROM composition WHERE model = '{m}' AND writer_layer = 0 AND writer_head = 1
              AND reader_layer = {r} AND reader_head = 0) c
        LEFT JOIN (SELECT * FROM calibration WHERE model = '{m}' AND writer_layer = 0 AND writer_head = 1
              AND reader_layer = {r} AND reader_head = 0) p
        USING (checkpoint, metric, space, comp) ORDER BY c.metric, c.space, c.comp, c.checkpoint""",
    "discoveries per layer distance (every cell)": """
        SELECT metric, space, comp, reader_layer - writer_layer AS distance, count(*) AS discoveries
        FROM calibration WHERE model = '{m}' AND checkpoint = '{c}' AND q_value <= 0.05
        GROUP BY ALL ORDER BY ALL""",
}


def child_report(db: str, out: str, png: bool) -> dict:
    from compatlas.report import build_report

    t0 = time.perf_counter()
    files = build_report(db, out, png=png)
    return {"report_s": time.perf_counter() - t0,
            "files": {f.name: f.stat().st_size for f in files}}


def child_queries(db: str, L: int) -> dict:
    from compatlas.atlas import connect

    out = {}
    for name, sql in QUERIES.items():
        times, rows = [], 0
        for _ in range(3):
            con = connect(db)  # a fresh connection each time: nothing cached between runs
            t0 = time.perf_counter()
            rows = len(con.execute(sql.format(m=MODEL, c=CHECKPOINT, r=L - 1)).fetchall())
            times.append(time.perf_counter() - t0)
            con.close()
        out[name] = {"median_s": statistics.median(times), "times_s": times, "rows": rows}
    return out


def run_child(args: list[str], max_rss_gb: float) -> tuple[dict | None, float]:
    """Run this script as a child with ``args``; return (its JSON result, its peak RSS in GB).
    A watchdog kills it past ``max_rss_gb`` (the machine is shared)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    proc = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True)
    killed, hwm = [], [0.0]

    def watch():
        while proc.poll() is None:
            try:
                with open(f"/proc/{proc.pid}/status") as fh:
                    st = {x.split(":")[0]: int(x.split()[1]) / 2**20 for x in fh if x.startswith(("VmRSS:", "VmHWM:"))}
            except (OSError, ValueError):
                return
            rss = st.get("VmRSS", 0.0)
            hwm[0] = max(hwm[0], st.get("VmHWM", 0.0))
            if rss > max_rss_gb:
                killed.append(rss)
                proc.kill()
                return
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()
    stdout, _ = proc.communicate()
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # the child's own peak: its VmHWM as last polled, or ru_maxrss where this child raised it
    peak_gb = max(hwm[0], peak / 2**20 if peak > before else 0.0)
    if killed:
        print(f"!! child killed at {killed[0]:.1f} GB resident (limit {max_rss_gb} GB)", file=sys.stderr)
        return None, killed[0]
    if proc.returncode != 0:
        print(f"!! child failed ({proc.returncode})", file=sys.stderr)
        return None, peak_gb
    return json.loads(stdout.strip().splitlines()[-1]), peak_gb


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/atlas-70b"))
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--no-png", action="store_true")
    ap.add_argument("--build-only", action="store_true", help="build (or check) the atlas and stop")
    ap.add_argument("--max-rss-gb", type=float, default=6.0, help="kill a measured child past this (default 6)")
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    db = args.dir / "atlas.duckdb"
    if args._child == "report":
        print(json.dumps(child_report(str(db), str(args.dir / "report"), not args.no_png)))
        return 0
    if args._child == "queries":
        print(json.dumps(child_queries(str(db), args.layers)))
        return 0

    t0 = time.perf_counter()
    existed = db.exists()
    build(args.dir, args.layers, args.heads)
    print(f"atlas {args.layers} x {args.heads} under {args.dir}: "
          f"{'reused' if existed and time.perf_counter() - t0 < 60 else 'built'} in {time.perf_counter() - t0:.0f} s, "
          f"{sum(f.stat().st_size for f in args.dir.rglob('*.parquet')) / 1e9:.1f} GB of shards")
    if args.build_only:
        return 0
    common = ["--dir", str(args.dir), "--layers", str(args.layers), "--heads", str(args.heads)] + (["--no-png"] if args.no_png else [])
    rep, rss = run_child(["--_child", "report", *common], args.max_rss_gb)
    ok = rep is not None
    if rep:
        page = max(v for k, v in rep["files"].items() if k.startswith("model-")) / 1e6
        overview = rep["files"].get("index.html", 0) / 1e6
        print(f"report: {rep['report_s']:.1f} s (target <= {TARGETS['report_s']:.0f}), peak RSS {rss:.2f} GB "
              f"(target <= {TARGETS['report_rss_gb']:.0f}), model page {page:.2f} MB (target <= {TARGETS['page_mb']:.0f}), "
              f"overview {overview:.2f} MB, {sum(1 for k in rep['files'] if k.endswith('.png'))} PNGs")
        ok &= rep["report_s"] <= TARGETS["report_s"] and rss <= TARGETS["report_rss_gb"] and page <= TARGETS["page_mb"]
    qs, qrss = run_child(["--_child", "queries", *common], args.max_rss_gb)
    if qs:
        for name, r in qs.items():
            print(f"query {name}: {r['median_s']:.2f} s median of 3 ({r['rows']} rows; target <= {TARGETS['query_s']:.0f} s)")
            ok &= r["median_s"] <= TARGETS["query_s"]
        print(f"queries' peak RSS {qrss:.2f} GB")
    ok &= qs is not None
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
