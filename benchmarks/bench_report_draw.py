"""How long the report's pages take to draw in a browser: the target is every figure of a page of
the default run drawn within 3 s of the page's opening, on an idle machine.

The report is built by ``compatlas.report.build_report`` (what the ``report`` rule runs) from a
synthetic atlas of the default run's shapes (``tests/synthetic_atlas.default_run``: a SmolLM2-like
30 x 9 model with edge attribution, two random 4 x 8 models, the trained 2 x 2 model's 9
checkpoints; 4 metrics x 4 spaces). Each page is opened in headless Chromium with every figure
drawn at once (``#drawall``); the page stamps each figure's time (``data-drawn-ms``, from the
page's navigation start) and the last stamp is the page's draw time; best of ``--repeats``.

The reference, measured in the same run and the same browser: a page of the same build holding
one one-point figure, i.e. what loading Vega's 0.9 MB script and drawing anything at all costs
on this machine; a page's draw time less that is what its own figures cost.

    python benchmarks/bench_report_draw.py [--repeats 3] [--dir /tmp/bench-report-draw]
    python benchmarks/bench_report_draw.py --report results/report   # a report already built (the default run's)

Needs Chromium (Debian's ``chromium``). Run it alone: a busy machine draws slower.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import altair as alt
from browser import Browser, chromium
from synthetic_atlas import DEFAULT_SPACES, default_run, write_suite

from compatlas.report import build_report
from compatlas.report.page import Page

TARGET_S = 3.0
PROBE = "Math.max(...[...document.querySelectorAll('div.fig[data-spec]')].map(e => Number(e.dataset.drawnMs)))"


def reference_page(out: Path) -> Path:
    page = Page(out, "reference.html", "reference", png=False)
    page.figure(alt.Chart(alt.Data(values=[{"x": 1}])).mark_point().encode(x="x:Q"), "reference")
    return page.write()


def draw_seconds(browser: Browser, page: Path, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        v = browser.visit(page, probe=PROBE)
        if v.drawn != v.figures or v.failed or v.errors:
            raise SystemExit(f"{page.name}: {v.figures - v.drawn} figures not drawn, {v.failed or v.errors}")
        times.append(v.probe / 1000)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/bench-report-draw"))
    ap.add_argument("--report", type=Path, help="time this report's pages instead of building the synthetic one")
    args = ap.parse_args()
    if chromium() is None:
        raise SystemExit("Chromium is not installed: `apt-get install -y chromium`")
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    report = args.dir / "report"
    if args.report:
        shutil.copytree(args.report, report)  # the reference page is written beside the pages, not into the run's
    else:
        build_report(write_suite(args.dir, default_run(), spaces=DEFAULT_SPACES), report, png=False)
    reference = reference_page(report)
    print(f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; best of {args.repeats}; target {TARGET_S:.1f} s")
    browser = Browser(chromium())
    try:
        base = draw_seconds(browser, reference, args.repeats)
        print(f"{'page':32} {'MB':>6} {'drawn (s)':>10} {'less ref (s)':>13} {'/ target':>9}")
        print(f"{'reference (one point)':32} {reference.stat().st_size / 1e6:6.2f} {base:10.2f} {0:13.2f} {base / TARGET_S:9.2f}")
        worst = 0.0
        for page in sorted(report.glob("*.html")):
            if page == reference:
                continue
            t = draw_seconds(browser, page, args.repeats)
            worst = max(worst, t)
            print(f"{page.name:32} {page.stat().st_size / 1e6:6.2f} {t:10.2f} {t - base:13.2f} {t / TARGET_S:9.2f}")
    finally:
        browser.close()
    print(f"slowest page {worst:.2f} s: target {'met' if worst <= TARGET_S else 'NOT met'}")


if __name__ == "__main__":
    main()
