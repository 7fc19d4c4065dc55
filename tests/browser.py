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


# What each figure of a page draws, read from its Vega view (the page keeps vega-embed's result on
# the figure's div: ``el.vega``), in every state of its bound menu or radio buttons (the circuit's
# metric · space, the heatmap's comp): per legend its scale's domain, the range of the field the
# scale encodes over the drawn marks' items, and its labels; the rows the heatmap's discovery
# squares (mark "discoveries") and the circuit's curves (marks "edges_Q", "edges_K", "edges_V":
# one row per curve) draw.
DATA_PROBE = r"""(async () => {
  const KEYS = ['c', 'w', 'r', 'q', 'combo', 'comp', 'kind', 'wl', 'wh', 'rl', 'rh', 'eid', 'score'];
  const pick = d => Object.fromEntries(KEYS.filter(k => d[k] !== undefined).map(k => [k, d[k]]));
  const text = t => Array.isArray(t) ? t.join(' ') : String(t);
  const figs = [];
  for (const el of document.querySelectorAll('div.fig[data-spec]')) {
    const res = el.vega;
    if (!res) { figs.push({spec: el.dataset.spec, drawn: false}); continue; }
    const view = res.view, vg = res.vgSpec;
    const scales = {}, uses = {}, vlegends = [];
    (function scan(s) {
      for (const sc of s.scales || []) scales[sc.name] = sc;
      for (const lg of s.legends || []) vlegends.push(lg);
      for (const m of s.marks || []) {
        for (const part of ['enter', 'update']) for (const ch of Object.values((m.encode || {})[part] || {}))
          for (const e of [].concat(ch)) if (e && e.scale && typeof e.field === 'string')
            (uses[e.scale] = uses[e.scale] || []).push([m.name, e.field]);
        scan(m);
      }
    })(vg);
    const sig = (vg.signals || []).find(s => s.bind && Array.isArray(s.bind.options));
    const title = vg.title ? text(vg.title.text !== undefined ? vg.title.text : vg.title) : '';
    const states = [];
    for (const v of (sig ? sig.bind.options : [null])) {
      if (sig) await view.signal(sig.name, v).runAsync();
      const byName = {}, shown = [];
      (function walk(mark) {
        if (mark.role === 'legend') {
          for (const g of mark.items || []) {
            const lg = {title: [], labels: [], values: [], opacity: []};
            (function inner(m) {
              for (const it of m.items || []) {
                if (m.role === 'legend-title' && it.text !== undefined) lg.title.push(text(it.text));
                if (m.role === 'legend-label') { lg.labels.push(text(it.text)); lg.values.push(it.datum ? it.datum.value : null);
                                                 lg.opacity.push(it.opacity === undefined ? 1 : it.opacity); }
                for (const c of it.items || []) inner(c);
              }
            })({items: [g]});
            shown.push(lg);
          }
          return;
        }
        const rows = byName[mark.name || ''] = byName[mark.name || ''] || [];
        for (const it of mark.items || []) { if (it.datum && mark.marktype !== 'group') rows.push(it.datum);
                                             for (const c of it.items || []) walk(c); }
      })(view.scenegraph().root);
      const legends = vlegends.map(lg => {
        const s = lg.fill || lg.stroke || lg.size || lg.strokeWidth || lg.strokeDash || lg.shape || lg.opacity;
        let domain = null;
        try { domain = view.scale(s).domain(); } catch (e) { domain = null; }
        const vals = (uses[s] || []).flatMap(([m, f]) => (byName[m] || []).map(d => d[f]))
          .filter(x => typeof x === 'number' && isFinite(x));
        const t = lg.title === undefined ? '' : (typeof lg.title === 'object' && !Array.isArray(lg.title) ? '' : text(lg.title));
        const scene = shown.find(x => x.title.join(' ') === t) || null;
        return {title: t, scale: s, type: scales[s] ? scales[s].type : null, fixed: !!scales[s] && Array.isArray(scales[s].domain),
                clamp: !!(scales[s] && scales[s].clamp), domain: domain ? Array.from(domain) : null,
                drawn: vals.length ? [Math.min(...vals), Math.max(...vals)] : null, n: vals.length,
                labels: scene ? scene.labels : null, opacity: scene ? scene.opacity : null};
      });
      const marks = {};
      for (const [name, rows] of Object.entries(byName)) {
        const m = /^(discoveries|edges_[A-Z]+)(_[0-9]+)?_marks$/.exec(name);  // Vega-Lite may number a layer's name
        if (!m) continue;
        const seen = new Map();
        for (const d of rows) { const k = d.eid !== undefined ? d.eid : JSON.stringify(pick(d)); if (!seen.has(k)) seen.set(k, pick(d)); }
        marks[m[1]] = (marks[m[1]] || []).concat([...seen.values()]);
      }
      states.push({value: v, legends, marks});
    }
    figs.push({spec: el.dataset.spec, drawn: true, title, signal: sig ? sig.name : null, states});
  }
  return figs;
})()"""


def legend_problems(figs: list[dict]) -> list[str]:
    """Each legend of a quantitative scale against what its figure draws: the drawn values lie in
    the scale's domain (beyond its end only where the scale clamps, the end's label then saying
    "≥"); a domain not given as numbers in the spec (taken from the data, or from an expression
    over the picked state) is the drawn values' [smallest, largest]; its labels differ."""
    out = []
    for f in figs:
        for st in f.get("states", []):
            at = f"{f['spec']} ({f['title'][:40]}){'' if st['value'] is None else ' at ' + str(st['value'])}"
            for lg in st["legends"]:
                dom, drawn = lg["domain"], lg["drawn"]
                if not dom or len(dom) != 2 or not all(isinstance(x, (int, float)) for x in dom) or drawn is None:
                    continue
                lo, hi = min(dom), max(dom)
                tol = 1e-9 * max(abs(lo), abs(hi), 1e-300)
                if lg["fixed"]:
                    if drawn[0] < lo - tol or (drawn[1] > hi + tol and not lg["clamp"]):
                        out.append(f"{at}: legend {lg['title']!r}: drawn {drawn} outside its domain {dom}")
                    if drawn[1] > hi + tol and lg["clamp"] and not any(str(x).startswith("≥") for x in lg["labels"] or []):
                        out.append(f"{at}: legend {lg['title']!r}: values beyond {hi} drawn at its end, not labelled ≥")
                elif abs(lo - drawn[0]) > tol or abs(hi - drawn[1]) > tol:
                    out.append(f"{at}: legend {lg['title']!r}: domain {dom}, but the drawn values span {drawn}")
                shown = [x for x, o in zip(lg["labels"] or [], lg["opacity"] or []) if o]
                if len(set(shown)) != len(shown):
                    out.append(f"{at}: legend {lg['title']!r}: labels repeat: {shown}")
    return out


def drawn_discovery_problems(name: str, figs: list[dict], con: Any, model: str, n_heads: int,
                             edge_max: int, largest_n: int) -> list[str]:
    """The discoveries a model page draws against the atlas's ``discoveries`` view (its last
    checkpoint): the heatmap's squares, per comp, are the view's rows of its metric x space; the
    circuit's "discovery" curves, per metric x space, are the view's rows (its ``edge_max`` with
    the smallest q where it has more); a magnitude's "largest score" curves are its ``largest_n``
    tests per comp with the largest scores (ties: in the order of their heads)."""
    import re as _re

    out = []

    def view_rows(metric: str, space: str, comp: str | None = None) -> set[tuple]:
        sql = ("SELECT comp, writer_layer, writer_head, reader_layer, reader_head FROM discoveries WHERE model = ? AND latest "
               "AND metric = ? AND space = ?" + (" AND comp = ?" if comp else ""))
        return set(con.execute(sql, [model, metric, space, *([comp] if comp else [])]).fetchall())

    for f in figs:
        if not f.get("drawn"):
            continue
        for st in f["states"]:
            marks = st["marks"]
            if "discoveries" in marks:  # the heatmap, in its comp st["value"]
                m = _re.search(r"@ .*?: (\S+), (\S+) space", f["title"])
                if not m:
                    out.append(f"{name}: a heatmap without its metric and space in the title: {f['title']!r}")
                    continue
                drawn = {(d["c"], d["w"], d["r"]) for d in marks["discoveries"]}
                want = {(c, wl * n_heads + wh, rl * n_heads + rh) for c, wl, wh, rl, rh in view_rows(*m.groups(), st["value"])}
                if drawn != want:
                    out.append(f"{name}: heatmap {m.group(1)} · {m.group(2)} {st['value']}: draws {len(drawn)} discoveries, "
                               f"the view holds {len(want)} ({len(want - drawn)} not drawn, {len(drawn - want)} not in it)")
            curves = [d for k, rows in marks.items() if k.startswith("edges_") for d in rows]
            if st["value"] is None or not any(k.startswith("edges_") for k in marks):
                continue
            metric, space = str(st["value"]).split(" · ")
            want = view_rows(metric, space)
            drawn = {(d["comp"], d["wl"], d["wh"], d["rl"], d["rh"]) for d in curves if d["kind"] == "discovery"}
            kinds = {d["kind"] for d in curves}
            if "largest score (a magnitude)" in kinds:
                top = set(con.execute("""SELECT comp, writer_layer, writer_head, reader_layer, reader_head FROM composition_z
                                         WHERE model = ? AND latest AND metric = ? AND space = ?
                                         QUALIFY dense_rank() OVER (PARTITION BY comp ORDER BY score DESC, writer_layer,
                                           writer_head, reader_layer, CASE WHEN test_unit = 'kv_head'
                                           THEN -1 - reader_kv_head ELSE reader_head END) <= ?""",
                                      [model, metric, space, largest_n]).fetchall())
                big = {(d["comp"], d["wl"], d["wh"], d["rl"], d["rh"]) for d in curves if d["kind"] == "largest score (a magnitude)"}
                if big != top:
                    out.append(f"{name}: circuit {st['value']}: draws {len(big)} largest scores, not its {len(top)} largest")
            elif len(want) <= edge_max and drawn != want:
                out.append(f"{name}: circuit {st['value']}: draws {len(drawn)} discoveries, the view holds {len(want)}")
            elif len(want) > edge_max and (not drawn <= want or len(drawn) != edge_max):
                out.append(f"{name}: circuit {st['value']}: draws {len(drawn)} of the view's {len(want)} discoveries")
            if want and "smallest p (no discoveries)" in kinds:
                out.append(f"{name}: circuit {st['value']}: draws smallest-p pairs where the view holds discoveries")
    return out


def data_problems(report_dir: Path, db: Path, edge_max: int, largest_n: int) -> tuple[list[str], dict[str, Any]]:
    """Every model page's figures read in Chromium (DATA_PROBE): their legends (legend_problems)
    and the discoveries they draw against the atlas (drawn_discovery_problems). Returns the
    problems and what the probe read, by page."""
    from compatlas.atlas import connect
    from compatlas.report.page import safe_name

    con = connect(db)
    models = {f"model-{safe_name(m)}.html": (m, int(h)) for m, h in
              con.execute("SELECT model, n_heads FROM models WHERE checkpoint IN "
                          "(SELECT checkpoint FROM checkpoints c WHERE c.model = models.model AND latest)").fetchall()}
    read = probe_pages(report_dir, sorted(p.name for p in report_dir.glob("model-*.html")), DATA_PROBE)
    problems = []
    for name, figs in read.items():
        problems += [f"{name}: {p}" for p in legend_problems(figs)]
        if name in models:
            problems += drawn_discovery_problems(name, figs, con, *models[name], edge_max, largest_n)
    con.close()
    return problems, read
