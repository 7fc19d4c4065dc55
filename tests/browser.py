"""Open a page in headless Chromium and report what a reader would meet: requests that leave the
file, console errors, figures that did not draw, the page's width; and take a screenshot.

Chromium is driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: JSON
messages separated by NUL on file descriptors 3 and 4), so no CDP client library is needed."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WIDTH, HEIGHT = 1280, 900
LOCAL = ("file:", "data:", "blob:", "about:")


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if p := shutil.which(name):
            return p
    return None


@dataclass
class Visit:
    url: str
    external: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # console warnings (Vega logs "WARN ..." there)
    figures: int = 0
    drawn: int = 0
    failed: list[str] = field(default_factory=list)
    width: int = 0
    height: int = 0
    window: int = 0  # the window's width the page was drawn at
    clipped: list[str] = field(default_factory=list)  # figures wider than their box (an inner horizontal scroll)
    probe: object = None  # what the visit's ``probe`` script returned


class Browser:
    def __init__(self, binary: str):
        self.profile = tempfile.mkdtemp(prefix="compatlas-chromium-")
        r_ours, w_chrome = os.pipe()  # chromium writes on its fd 4
        r_chrome, w_ours = os.pipe()  # chromium reads on its fd 3
        # above any fd the child's dup2 onto 3 and 4 could clobber
        r_hi, w_hi = os.dup2(r_chrome, 100, inheritable=True), os.dup2(w_chrome, 101, inheritable=True)
        self.proc = subprocess.Popen(
            [binary, "--headless", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-extensions", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", "--disable-default-apps", f"--user-data-dir={self.profile}", "--hide-scrollbars",
             "--mute-audio", "about:blank"],
            pass_fds=(3, 4), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=lambda: (os.dup2(r_hi, 3), os.dup2(w_hi, 4)))
        os.close(r_hi)
        os.close(w_hi)
        os.close(r_chrome)
        os.close(w_chrome)
        self.w, self.r = os.fdopen(w_ours, "wb", buffering=0), os.fdopen(r_ours, "rb", buffering=0)
        self.buf, self.next_id, self.events = b"", 0, []

    def _read(self, timeout: float) -> dict:
        import select

        while b"\0" not in self.buf:
            ready, _, _ = select.select([self.r], [], [], timeout)
            if not ready:
                raise TimeoutError("Chromium did not answer")
            chunk = self.r.read(1 << 16)
            if not chunk:
                raise RuntimeError("Chromium closed its pipe")
            self.buf += chunk
        msg, self.buf = self.buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 60) -> dict:
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self.w.write(json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            m = self._read(max(0.1, deadline - time.monotonic()))
            if m.get("id") == self.next_id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            self.events.append(m)

    def drain(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                self.events.append(self._read(max(0.05, end - time.monotonic())))
            except TimeoutError:
                return

    def visit(self, path: Path, screenshot: Path | None = None, timeout: float = 120, tile: int = 0,
              width: int = WIDTH, probe: str | None = None) -> Visit:
        """Load ``path`` in a window ``width`` px wide, draw every figure (the page's ``#drawall``),
        and report. ``probe``: a JavaScript expression evaluated once every figure is drawn (a
        promise is awaited), its JSON-able value kept in ``Visit.probe``."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        s = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for m in ("Page.enable", "Runtime.enable", "Log.enable", "Network.enable"):
            self.call(m, session=s)
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False}, session=s)
        self.events = []
        url = path.resolve().as_uri()
        v = Visit(url, window=width)
        self.call("Page.navigate", {"url": url + "#drawall"}, session=s)
        deadline = time.monotonic() + timeout
        js = ("JSON.stringify({n: document.querySelectorAll('div.fig[data-spec]').length,"
              " d: document.querySelectorAll('div.fig[data-drawn]').length,"
              " f: [...document.querySelectorAll('div.fig')].filter(e => e.textContent.includes('Could not draw'))"
              ".map(e => e.textContent.slice(0, 300)),"
              # a figure whose drawing is wider than its box scrolls inside it: its right edge (a caption's end,
              # a legend) is cut off at first sight; named by the figure's spec id and the two widths
              " c: [...document.querySelectorAll('div.fig')].filter(e => e.scrollWidth > e.clientWidth)"
              ".map(e => `${e.dataset.spec}: ${e.scrollWidth} px drawn in a ${e.clientWidth} px box`),"
              " w: document.documentElement.scrollWidth, h: document.documentElement.scrollHeight,"
              " ok: document.readyState === 'complete' && location.protocol === 'file:'})")
        while True:
            state = json.loads(self.call("Runtime.evaluate", {"expression": js, "returnByValue": True},
                                         session=s)["result"].get("value") or "{}")
            if (state.get("ok") and state["n"] == state["d"] + len(state["f"])) or time.monotonic() > deadline:
                break
            self.drain(0.5)
        self.drain(1.0)
        v.figures, v.drawn, v.failed, v.width, v.height = state["n"], state["d"], state["f"], state["w"], state["h"]
        v.clipped = state.get("c", [])
        if probe is not None:
            r = self.call("Runtime.evaluate", {"expression": probe, "returnByValue": True, "awaitPromise": True},
                          session=s)
            if "exceptionDetails" in r:
                raise RuntimeError(f"probe failed: {r['exceptionDetails']}")
            v.probe = r["result"].get("value")
        for e in self.events:
            p, m = e.get("params", {}), e.get("method")
            if m == "Network.requestWillBeSent" and not p["request"]["url"].startswith(LOCAL):
                v.external.append(p["request"]["url"])
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                v.errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
            elif m == "Runtime.consoleAPICalled" and p.get("type") == "warning":
                v.warnings.append(" ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
            elif m == "Runtime.exceptionThrown":
                v.errors.append(p["exceptionDetails"].get("exception", {}).get("description", "exception"))
            elif m == "Log.entryAdded" and p["entry"]["level"] == "error":
                v.errors.append(f"{p['entry'].get('source')}: {p['entry']['text']} {p['entry'].get('url', '')}")
        if screenshot is not None:  # the whole page, and with ``tile`` also in pieces of that height
            pieces = [(0, min(v.height, 16000), screenshot)]
            if tile:
                pieces += [(y, min(tile, v.height - y), screenshot.with_name(f"{screenshot.stem}_{i}.png"))
                           for i, y in enumerate(range(0, v.height, tile))]
            for y, h, out in pieces:
                shot = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True,
                                                            "clip": {"x": 0, "y": y, "width": width, "height": h, "scale": 1}},
                                 session=s)
                out.write_bytes(base64.b64decode(shot["data"]))
        self.call("Target.closeTarget", {"targetId": target})
        return v

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.profile, ignore_errors=True)


def check_report(report_dir: Path, shots: Path, widths: tuple[int, ...] = (WIDTH, 1400)) -> list[str]:
    """Open every page of a report in a window of each of ``widths`` px; screenshots (at the first
    width) into ``shots``; return the problems found (external requests, console errors, figures
    not drawn, a figure wider than its box, a page wider than its window)."""
    binary = chromium()
    if binary is None:
        raise RuntimeError("Chromium is not installed: `apt-get install -y chromium` (Debian's package; "
                           "envs/setup.sh installs it where apt-get is available)")
    shots.mkdir(parents=True, exist_ok=True)
    problems = []
    b = Browser(binary)
    try:
        for width in widths:
            for page in sorted(report_dir.glob("*.html")):
                v = b.visit(page, shots / f"{page.stem}.png" if width == widths[0] else None, width=width)
                name = page.name if width == widths[0] else f"{page.name} at {width} px"
                if width == widths[0]:  # what does not depend on the window's width, reported once
                    problems += [f"{name}: request leaves the file: {u}" for u in v.external]
                    problems += [f"{name}: console error: {e}" for e in v.errors]
                    # Vega's own warnings ("WARN domainMid exceeds domain", an unknown field): a figure drawn wrong
                    problems += [f"{name}: Vega warning: {w}" for w in v.warnings if "WARN" in w]
                    problems += [f"{name}: {f}" for f in v.failed]
                    if v.drawn != v.figures:
                        problems.append(f"{name}: {v.drawn} of {v.figures} figures drawn")
                problems += [f"{name}: figure clipped: {c}" for c in v.clipped]
                if v.width > width:
                    problems.append(f"{name}: {v.width} px wide in a {width} px window")
    finally:
        b.close()
    return problems


def probe_pages(report_dir: Path, names: list[str], probe: str) -> dict[str, Any]:
    """Each named page of a report opened in one Chromium, ``probe`` (a JavaScript expression)
    evaluated once its figures are drawn: file name -> what it returned."""
    binary = chromium()
    if binary is None:
        raise RuntimeError("Chromium is not installed: `apt-get install -y chromium`")
    b = Browser(binary)
    try:
        return {name: b.visit(report_dir / name, probe=probe).probe for name in names}
    finally:
        b.close()


# What the circuit's menu (a vega-embed <select name="combo">) opened on, which of the page's
# per-metric x space parts (data-combo) show, and which show after picking each other option
# (the select set and its 'change' dispatched, as a reader's pick does).
MENU_PROBE = """(async () => {
  const sel = document.querySelector('div.fig select[name="combo"]');
  if (!sel) return null;
  const shown = () => [...document.querySelectorAll('[data-combo]')].filter(e => !e.hidden).map(e => e.dataset.combo);
  const out = {opened: sel.value, shown: shown(), options: [...sel.options].map(o => o.value), picks: []};
  for (const v of out.options.filter(v => v !== out.opened).concat([out.opened])) {
    sel.value = v;
    sel.dispatchEvent(new Event('change'));
    await new Promise(r => setTimeout(r, 50));
    out.picks.push({to: v, shown: shown()});
  }
  return out;
})()"""


def menu_problems(report_dir: Path, expected: dict[str, str]) -> list[str]:
    """For each page named in ``expected`` (file name -> "metric · space"): the circuit's menu opens
    on that metric x space, the page shows that one's tables only, and after each pick in the menu
    the picked one's only."""
    problems = []
    for name, m in probe_pages(report_dir, list(expected), MENU_PROBE).items():
        want = expected[name]
        if m is None:
            problems.append(f"{name}: no metric · space menu")
            continue
        if m["opened"] != want:
            problems.append(f"{name}: the menu opens on {m['opened']!r}, not {want!r}")
        if m["shown"] != [m["opened"]]:
            problems.append(f"{name}: opened on {m['opened']!r}, the page shows the tables of {m['shown']}")
        problems += [f"{name}: picked {p['to']!r}, the page shows the tables of {p['shown']}"
                     for p in m["picks"] if p["shown"] != [p["to"]]]
    return problems


# The function section (h2#function to the next h2) as a reader sees it (innerText: nothing hidden):
# its tables' rows, how many of each row's cells carry an interval "x [lo, hi]", and its sentences.
FUNCTION_PROBE = r"""(() => {
  const h = document.getElementById('function');
  if (!h) return null;
  const parts = [];
  for (let n = h.nextElementSibling; n && n.tagName !== 'H2'; n = n.nextElementSibling) parts.push(n);
  const iv = /^-?[0-9.]+(e-?[0-9]+)? \[-?[0-9.]+(e-?[0-9]+)?, -?[0-9.]+(e-?[0-9]+)?\]$/;
  const rows = parts.flatMap(p => p.tagName === 'TABLE' ? [...p.querySelectorAll('tbody tr')] : []);
  return {rows: rows.map(r => [...r.querySelectorAll('td')].filter(td => iv.test(td.innerText.trim())).length),
          text: parts.map(p => p.innerText).join('\n')};
})()"""


def function_problems(report_dir: Path, expected: dict[str, bool]) -> list[str]:
    """For each page named in ``expected`` (file name -> whether it has a function to predict):
    where it has, its agreement table shows every AUROC and Spearman with its interval and a
    sentence says which cell is best or which are tied; where it has not, the page says "No
    function to predict" and shows no agreement table."""
    problems = []
    for name, f in probe_pages(report_dir, list(expected), FUNCTION_PROBE).items():
        if f is None:
            problems.append(f"{name}: no function section")
        elif expected[name]:
            if not f["rows"] or min(f["rows"]) < 2:
                problems.append(f"{name}: agreement rows without their intervals: {f['rows']}")
            if "best" not in f["text"] and "tied" not in f["text"]:
                problems.append(f"{name}: no sentence names the best or the tied cells")
        elif f["rows"] or "No function to predict" not in f["text"]:
            problems.append(f"{name}: no function to predict, yet {len(f['rows'])} agreement rows and no such sentence")
    return problems
