"""The report on a synthetic suite shaped like a Pythia sweep: time and sizes, and how the cost
grows with models and with checkpoints.

Suite: 4 models (6 x 8, 12 x 12, 16 x 16 and 24 x 16 layers x heads), 30 checkpoints each,
3 metrics x 3 spaces (about 90M composition rows, and as many p/q values), built with
``tests/synthetic_atlas.py`` (real shards, views from ``compatlas.atlas.build_atlas``). The same
four models with 3 checkpoints, and the largest model alone with 30, are the references measured
in the same run: the report's cost should follow the models, not the checkpoints.

Targets (2 cores): the report in under 2 minutes, the overview under 5 MB, each model
page under 10 MB.

    python benchmarks/bench_report.py [--checkpoints 30] [--dir /tmp/bench-report] [--no-png] [--reuse]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from synthetic_atlas import Spec, write_suite

from compatlas.report import build_report
from compatlas.report.page import js_bundle
from compatlas.vocab import METRICS, SPACES

SHAPES = [("pythia-a", 6, 8), ("pythia-b", 12, 12), ("pythia-c", 16, 16), ("pythia-d", 24, 16)]


def steps(n: int) -> list[int]:
    """Pythia-like: 0, log-spaced to 512, then evenly to 143000."""
    early = [0] + [2 ** k for k in range(10)]
    return early[:n] if n <= len(early) else early + [round(143000 * (i + 1) / (n - len(early))) for i in range(n - len(early))]


def run(root: Path, specs: list[Spec], png: bool, reuse: bool = False) -> dict:
    t0 = time.perf_counter()
    if reuse and (root / "atlas.duckdb").exists():
        db = root / "atlas.duckdb"
    else:
        shutil.rmtree(root, ignore_errors=True)
        db = write_suite(root, specs, METRICS, SPACES)
    t1 = time.perf_counter()
    files = build_report(db, root / "report", png=png)
    t2 = time.perf_counter()
    pages = {f.name: f.stat().st_size for f in files if f.suffix == ".html"}
    pngs = [f for f in files if f.suffix == ".png"]
    rows = sum(s.n_layers * (s.n_layers - 1) // 2 * s.n_heads ** 2 * 27 * len(s.steps or [0]) for s in specs)
    return {"build_s": t1 - t0, "report_s": t2 - t1, "pages": pages, "n_png": len(pngs),
            "png_mb": sum(f.stat().st_size for f in pngs) / 1e6, "rows": rows}


def show(name: str, r: dict) -> None:
    big = max((v for k, v in r["pages"].items() if k != "index.html"), default=0)
    print(f"{name}: {r['rows'] / 1e6:.1f}M composition rows (atlas built in {r['build_s']:.0f} s); report "
          f"{r['report_s']:.1f} s, {len(r['pages'])} pages, overview {r['pages']['index.html'] / 1e6:.2f} MB, "
          f"largest model page {big / 1e6:.2f} MB, {r['n_png']} PNGs ({r['png_mb']:.1f} MB)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoints", type=int, default=30)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/bench-report"))
    ap.add_argument("--no-png", action="store_true")
    ap.add_argument("--reuse", action="store_true", help="keep the suites already in --dir (same --checkpoints)")
    a = ap.parse_args()
    png = not a.no_png
    t = time.perf_counter()
    js_bundle()  # once per process (cached): paid by whichever report comes first, so paid here
    print(f"Vega JavaScript bundle (once per report process): {time.perf_counter() - t:.1f} s")
    full = run(a.dir / "full", [Spec(n, L, H, steps(a.checkpoints)) for n, L, H in SHAPES], png, a.reuse)
    show(f"4 models x {a.checkpoints} checkpoints", full)
    few = run(a.dir / "few", [Spec(n, L, H, steps(3)) for n, L, H in SHAPES], png, a.reuse)
    show("4 models x 3 checkpoints", few)
    one = run(a.dir / "one", [Spec(*SHAPES[-1], steps(a.checkpoints))], png, a.reuse)
    show(f"1 model (24 x 16) x {a.checkpoints} checkpoints", one)
    print(f"ratio report time, {a.checkpoints} vs 3 checkpoints: {full['report_s'] / few['report_s']:.2f} "
          f"(checkpoints x{a.checkpoints / 3:.0f})")
    print(f"ratio report time, 4 models vs the largest alone: {full['report_s'] / one['report_s']:.2f}")
    big = max(v for k, v in full["pages"].items() if k != "index.html")
    print(f"targets: report {full['report_s']:.1f} s < 120 s: {full['report_s'] < 120}; overview "
          f"{full['pages']['index.html'] / 1e6:.2f} MB < 5 MB: {full['pages']['index.html'] < 5e6}; largest model page "
          f"{big / 1e6:.2f} MB < 10 MB: {big < 10e6}")


if __name__ == "__main__":
    main()
