"""The page shell: number formatting, HTML helpers, CSS, the inlined Vega JavaScript and the
``Page`` that collects a page's parts and figures (one Vega-Lite spec each, drawn when it
scrolls into view, and a PNG of it where asked)."""

from __future__ import annotations

import base64
import gzip
import html
import json
import math
import os
import re
from collections.abc import Iterable, Iterator
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

import altair as alt
import polars as pl

from compatlas.report.png import render_png
from compatlas.storage import atomic_path
from compatlas.vocab import METRICS, SPACES

COMP_COLOURS = {"Q": "#4c78a8", "K": "#e45756", "V": "#54a24b"}
WIDTH = 1280  # px: no page is wider than this window
CONTENT = WIDTH - 80  # px left for a figure inside the body's margins


# A figure's text is at most this wide: its div's box less vega-embed's 38 px for the figure's menu
TEXT_MAX = CONTENT - 60
CHAR_EM = 0.6  # a generous mean width of a character of the sans-serif font, in em (measured: about 0.5)


def wrap(lines: Iterable[str], px: float = TEXT_MAX, font_px: float = 11) -> list[str]:
    """Each line broken at spaces into lines of at most ``px`` (at ``CHAR_EM`` em a character):
    for a chart's title or subtitle, which Vega draws on one line however long. Vega counts a
    title in the chart's width, so an unbroken subtitle made the heatmap 1,358 px wide, its end
    cut off in a figure box of 1,216 px."""
    most = max(8, int(px / (CHAR_EM * font_px)))
    out: list[str] = []
    for line in lines:
        cur = ""
        for word in line.split(" "):
            if cur and len(cur) + 1 + len(word) > most:
                out.append(cur)
                cur = word
            else:
                cur = f"{cur} {word}" if cur else word
        out.append(cur)
    return out


def order(values: Iterable[Any], preferred: tuple[str, ...]) -> list[Any]:
    vals = set(v for v in values if v is not None)
    return [v for v in preferred if v in vals] + sorted(vals - set(preferred), key=str)


def by_metric_space(df: pl.DataFrame) -> Iterator[tuple[str, str, pl.DataFrame, dict[str, dict[str, Any]]]]:
    """Each metric x space of a per-comp table, in the usual order: (metric, space, its rows,
    its rows by comp)."""
    for metric in order(df["metric"].unique(), METRICS):
        for space in order(df.filter(pl.col("metric") == metric)["space"].unique(), SPACES):
            g = df.filter((pl.col("metric") == metric) & (pl.col("space") == space))
            yield metric, space, g, {r["comp"]: r for r in g.iter_rows(named=True)}


def safe_name(s: Any) -> str:
    """A file-name-safe version of a model / checkpoint / metric / space name."""
    return re.sub(r"[^A-Za-z0-9._+-]", "-", str(s)) or "-"


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def fmt(v: Any, digits: int = 3) -> str:
    """For reading: integers as integers, floats to ``digits`` significant digits, p-values in
    scientific notation below 1e-3, missing values as a dash."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) < 1e-3 or abs(v) >= 1e5:
            return f"{v:.{max(digits - 1, 1)}e}"
        return f"{v:#.{digits}g}".rstrip(".") if abs(v) < 10 ** digits else f"{v:,.0f}"
    return str(v)


def fmt_q(q: Any, cut: float | None) -> str:
    """A q-value with the digits that show its margin to the false discovery rate ``cut``: as
    ``fmt`` unless that rounds it onto the cut or across it (0.0499986 is "0.049999", not "0.0500")."""
    if not isinstance(q, float) or cut is None or math.isnan(q):
        return fmt(q)
    for digits in range(3, 10):
        text = fmt(q, digits)
        if (float(text) <= cut) == (q <= cut) and float(text) != cut:
            return text
    return f"{q:.10g}"


def correlation(v: Any) -> Any:
    """A correlation of exactly 0 computed in floating point (4.4e-17, its sign and last digits
    changing with DuckDB's parallel sums) shown as 0."""
    return 0.0 if isinstance(v, float) and abs(v) < 1e-12 else v


def step(v: Any) -> str:
    return "–" if not finite(v) else f"{int(round(v)):,}"  # noqa: RUF046 - a numpy float's round is a float


def esc(v: Any) -> str:
    return html.escape(fmt(v))


def head(layer: Any, h: Any) -> str:
    return f"L{layer}.H{h}"


def table(header: list[str], rows: list[list[Any]], cls: str = "", raw: bool = False) -> str:
    """An HTML table; cells are formatted with ``fmt`` and escaped unless ``raw`` (trusted HTML)."""
    th = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    cell = (lambda c: str(c)) if raw else esc
    # a raw cell that is its own "<td colspan=...>..." spans columns
    body = "".join("<tr>" + "".join(str(c) + "</td>" if raw and str(c).startswith("<td") else f"<td>{cell(c)}</td>"
                                    for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


def note(text: str) -> str:
    return f"<p class='note'>{text}</p>"


CSS = """
.excluded { border-left: 4px solid #c0392b; background: #fdf2f0; padding: 0.3em 1em; margin: 1em 0; }
* { box-sizing: border-box; }
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 1em 2em; color: #222;
       max-width: 1240px; }
td, th { overflow-wrap: break-word; }
table.models td, table.models th, table.finds td, table.finds th { text-align: left; }
h1 { margin-bottom: 0.2em; font-size: 1.6em; } h2 { border-top: 2px solid #ccc; padding-top: 0.5em; margin-top: 1.6em; }
h3 { margin: 1.2em 0 0.3em; }
table { border-collapse: collapse; font-size: 0.82em; margin: 0.4em 0; max-width: 100%; }
table.agree { font-size: 0.72em; }
th, td { border: 1px solid #ddd; padding: 2px 6px; text-align: right; vertical-align: top; }
th { background: #f0f0f0; } td:first-child, th:first-child { text-align: left; }
.note { color: #555; font-size: 0.88em; max-width: 62em; }
.fig { overflow-x: auto; max-width: 100%; min-height: 100px; }
.side { display: flex; flex-wrap: wrap; gap: 1.2em; align-items: flex-start; }
.pass { color: #1a7f37; font-weight: bold; } .fail { color: #cf222e; font-weight: bold; }
.png { font-size: 0.75em; } nav { font-size: 0.9em; margin: 0.5em 0; } nav a { margin-right: 1em; }
footer { border-top: 2px solid #ccc; margin-top: 2em; color: #555; font-size: 0.8em; }
footer pre { white-space: pre-wrap; font-size: 0.95em; }
"""

JS_EMBED = """(() => {
const opts = {renderer: "canvas", actions: {export: true, source: false, compiled: false, editor: false}};
// A spec is JSON, or above GZIP_OVER bytes gzip in base64 (Page.figure), unpacked by the browser
async function specOf(id) {
  const el = document.getElementById(id);
  if (el.type !== "application/gzip") return JSON.parse(el.textContent);
  const bytes = Uint8Array.from(atob(el.textContent.trim()), c => c.charCodeAt(0));
  const text = await new Response(new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"))).text();
  return JSON.parse(text);
}
function show(el) {
  if (el.dataset.done) return; el.dataset.done = "1";
  // the drawn view kept on its div (el.vega: vega-embed's result), and when it was drawn (ms after the page opened)
  specOf(el.dataset.spec).then(spec => vegaEmbed(el, spec, opts))
    .then(res => { el.vega = res; follow(res.view); el.dataset.drawnMs = Math.round(performance.now()); el.dataset.drawn = "1"; })
    .catch(e => { el.textContent = "Could not draw this figure: " + e; console.error(e); });
}
// A chart with a "combo" menu (the circuit's metric · space): the page's parts for one metric · space
// (elements with data-combo, e.g. the top-discoveries tables) show only the one the menu picks.
function follow(view) {
  try { view.signal("combo"); } catch (e) { return; }  // no such signal: not a chart with the menu
  const pick = v => document.querySelectorAll("[data-combo]").forEach(t => { t.hidden = t.dataset.combo !== v; });
  view.addSignalListener("combo", (name, v) => pick(v));
  pick(view.signal("combo"));
}
const figs = document.querySelectorAll("div.fig[data-spec]");
if ("IntersectionObserver" in window && !location.hash.includes("drawall")) {
  const io = new IntersectionObserver(es => es.forEach(e => { if (e.isIntersecting) { io.unobserve(e.target); show(e.target); } }),
                                      {rootMargin: "800px"});
  figs.forEach(f => io.observe(f));
} else { figs.forEach(show); }
})();
"""


@lru_cache(maxsize=1)
def js_bundle() -> str:
    """Vega, Vega-Lite and vega-embed as one script. vl-convert takes seconds to bundle them, so
    the bundle is kept in ``$COMPATLAS_CACHE`` (default ``~/.cache/compatlas``) per version."""
    import vl_convert as vlc

    try:
        from altair.utils._importers import vl_version_for_vl_convert

        vl = vl_version_for_vl_convert()
    except ImportError:  # pragma: no cover - altair internals moved
        vl = None
    cache = Path(os.environ.get("COMPATLAS_CACHE", Path.home() / ".cache" / "compatlas"))
    path = cache / f"vega-bundle-{safe_name(metadata.version('vl-convert-python'))}-{safe_name(vl)}.js"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    js = vlc.javascript_bundle(vl_version=vl) if vl else vlc.javascript_bundle()  # type: ignore[call-arg]  # the stub omits snippet's default (None)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_text(js, encoding="utf-8")
    except OSError:  # a read-only home: bundle again next time
        pass
    return js


def spec_json(chart: alt.TopLevelMixin, datasets: dict[str, Any] | None = None) -> str:
    """The Vega-Lite spec as JSON, with ``datasets`` added to its top-level datasets (so that
    Altair never walks large data)."""
    with alt.data_transformers.disable_max_rows():
        spec = chart.to_dict(validate=False)  # validation costs more than drawing; the browser test draws every spec
    if datasets:
        spec.setdefault("datasets", {}).update(datasets)
    # '<' escaped so no spec text can close the <script> element it sits in.
    return json.dumps(spec, separators=(",", ":"), allow_nan=False, default=float).replace("<", "\\u003c")


# A spec's JSON above this many bytes is embedded gzip-compressed, in base64 (the page's script
# unpacks it): a figure of every head pair of a 30-layer model, or of its 11,745 K edges, is 1 to
# 2 MB of JSON and a quarter of it compressed.
GZIP_OVER = 200_000
SPEC_TAG = re.compile(r'<script type="application/(json|gzip)" id="(spec\d+)">(.*?)</script>', re.S)


def embed(spec: str, sid: str) -> str:
    """The ``<script>`` element that carries a figure's spec (``spec_json``) on the page."""
    if len(spec) <= GZIP_OVER:
        return f'<script type="application/json" id="{sid}">{spec}</script>'
    packed = base64.b64encode(gzip.compress(spec.encode("utf-8"), mtime=0)).decode("ascii")  # mtime 0: the same page every build
    return f'<script type="application/gzip" id="{sid}">{packed}</script>'


def page_specs(text: str) -> dict[str, dict[str, Any]]:
    """Every figure's Vega-Lite spec of a report page (its HTML), by id, as the page's script reads them."""
    out = {}
    for kind, sid, body in SPEC_TAG.findall(text):
        raw = gzip.decompress(base64.b64decode(body)).decode("utf-8") if kind == "gzip" else body
        out[sid] = json.loads(raw)
    return out


class Page:
    """One HTML page: its parts in order, and its figures' PNGs (drawn by ``pool``, a
    ``png.PngPool``, when given, else here; none when ``png`` is false)."""

    def __init__(self, out_dir: Path, name: str, title: str, png: bool = True, pool: Any = None):
        self.out_dir, self.name, self.title, self.png, self.pool = out_dir, name, title, png, pool
        self.parts: list[str] = []
        self.written: list[Path] = []
        self.n_specs = 0

    def add(self, *s: str) -> None:
        self.parts.extend(x for x in s if x)

    def figure(self, chart: alt.TopLevelMixin, stem: str, datasets: dict[str, Any] | None = None,
               png: bool = True) -> None:
        """Add a figure; ``png=False`` for one too large to draw to a file quickly (its menu exports it)."""
        spec = spec_json(chart, datasets)
        if self.png and png:
            path = self.out_dir / f"{safe_name(stem)}.png"
            if self.pool is not None:
                self.pool.submit(spec, path)
            else:
                render_png(spec, path)
            self.written.append(path)
            link = f'<div class="png"><a href="{html.escape(path.name)}">PNG</a></div>'
        else:
            link = '<div class="png">PNG: the figure\'s ⋯ menu</div>'
        sid = f"spec{self.n_specs}"
        self.n_specs += 1
        self.add(f'{embed(spec, sid)}<div class="fig" data-spec="{sid}"></div>{link}')

    def write(self, footer: str = "") -> Path:
        doc = ("<!DOCTYPE html>\n<html lang='en'><head><meta charset='UTF-8'>"
               f"<meta name='viewport' content='width=device-width'><link rel='icon' href='data:,'><title>{html.escape(self.title)}</title>"
               f"<style>{CSS}</style><script type='text/javascript'>\n{js_bundle()}\n</script></head><body>\n"
               + "\n".join(self.parts) + footer
               + f"\n<script type='text/javascript'>{JS_EMBED}</script>\n</body></html>\n")
        path = self.out_dir / self.name
        with atomic_path(path) as tmp:
            tmp.write_text(doc, encoding="utf-8")
        self.written.append(path)
        return path
