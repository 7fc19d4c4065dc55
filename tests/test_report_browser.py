"""The report in a real browser: headless Chromium (Debian's ``chromium``) opens the overview
and every model page at 1280 px and checks that no request leaves the file, the console has no
error, every chart draws (no "Could not draw"), and no page is wider than 1280 px.

The screenshots are kept for a developer to look at: in ``$COMPATLAS_SCREENSHOTS`` when set,
else in the test's temporary folder (the path is printed; ``pytest -s`` shows it). Where Chromium
is missing the test fails and says how to install it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from browser import check_report, chromium
from compatlas.report import build_report
from synthetic_atlas import Spec, write_suite


def screenshots(tmp: Path, name: str) -> Path:
    base = Path(os.environ["COMPATLAS_SCREENSHOTS"]) if os.environ.get("COMPATLAS_SCREENSHOTS") else tmp
    return base / name


def test_pages_in_chromium(tmp_path):
    if chromium() is None:
        pytest.fail("Chromium is not installed: `apt-get install -y chromium` (Debian's package; envs/setup.sh "
                    "installs it where apt-get is available)")
    # a planted circuit in a 12 x 8 model (the widest heatmap here), a checkpoint series (both with edge
    # attribution), a one-layer model
    db = write_suite(tmp_path, [Spec("wide", 12, 8, quantized=True, edges=True),
                                Spec("run", 2, 2, steps=[0, 4, 64, 200, 400], edges=True), Spec("solo", 1, 2)])
    build_report(db, tmp_path / "report", png=False)
    shots = screenshots(tmp_path, "synthetic")
    problems = check_report(tmp_path / "report", shots)
    print(f"screenshots: {shots}")
    assert not problems, "\n".join(problems)
    assert {p.name for p in shots.glob("*.png")} == {"index.png", "model-wide.png", "model-run.png", "model-solo.png"}


def test_the_check_sees_what_goes_wrong(tmp_path):
    """A page with a chart Vega cannot draw, a request to the network, a console error and a
    2000 px block: every one is reported."""
    if chromium() is None:
        pytest.fail("Chromium is not installed: `apt-get install -y chromium`")
    build_report(write_suite(tmp_path, [Spec("m", 2, 2)]), tmp_path / "report", png=False)
    good = (tmp_path / "report" / "index.html").read_text(encoding="utf-8")
    bad_spec = '{"mark": "no-such-mark", "data": {"values": [{"a": 1}]}, "encoding": {"x": {"field": "a"}}}'
    extra = (f'<script type="application/json" id="bad">{bad_spec}</script><div class="fig" data-spec="bad"></div>'
             '<img src="http://192.0.2.1/x.png"><div style="width: 2000px">wide</div>'
             '<script>console.error("boom")</script>')
    page = tmp_path / "bad" / "index.html"
    page.parent.mkdir()
    page.write_text(good.replace("<body>\n", "<body>\n" + extra, 1), encoding="utf-8")
    problems = "\n".join(check_report(page.parent, tmp_path / "shots"))
    assert "Could not draw" in problems and "http://192.0.2.1/x.png" in problems
    assert "console error: boom" in problems and "px wide" in problems
