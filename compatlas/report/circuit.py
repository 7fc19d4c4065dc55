"""The circuit view: a model's discoveries as a layered node-link graph (heads placed by layer
and head, one curved edge per discovery, one panel per comp, weighted by score), one metric x
space at a time through a dropdown; and the rule that picks the metric x space a model's page
opens on (``lead_cell``)."""

from __future__ import annotations

import html
import json

import altair as alt
import polars as pl

from compatlas.report.page import COMP_COLOURS, CONTENT, order, wrap
from compatlas.report.queries import EDGE_MAX, STRONGEST_PER_COMP
from compatlas.tables import integer, number
from compatlas.vocab import COMPS, METRICS, SPACES

PREV, IND, OTHER = "previous-token head", "induction head", "other head"

# The rule of ``lead_cell``, as the page states it
LEAD_RULE = ("the metric · space with the most K-composition discoveries from a previous-token head into an "
             "induction head (ties: the larger share of its K discoveries that are such edges); where no metric · "
             "space has one, the metric audit's lead (subspace in token space, the one metric · space that "
             "satisfies all four axioms)")


def circuit_counts(circuit: pl.DataFrame, summary: pl.DataFrame) -> pl.DataFrame:
    """Per metric x space of ``summary`` (queries.calibration_summary): ``k``, its K-composition
    discoveries, and ``circuit``, how many of them are from a previous-token head into an
    induction head (``circuit``: queries.circuit_edges; a test shared by a KV head's query heads
    counts once, as ``k`` counts it)."""
    if summary.is_empty() or "discoveries" not in summary.columns:
        return pl.DataFrame(schema={"metric": pl.Utf8, "space": pl.Utf8, "k": pl.Int64, "circuit": pl.Int64})
    k = summary.filter(pl.col("comp") == "K").select("metric", "space", k=pl.col("discoveries").fill_null(0).cast(pl.Int64))
    if circuit.is_empty():
        return _usual_order(k.with_columns(circuit=pl.lit(0, pl.Int64)))
    c = circuit.group_by("metric", "space").agg(circuit=pl.col("test").n_unique().cast(pl.Int64))
    return _usual_order(k.join(c, on=["metric", "space"], how="left").with_columns(pl.col("circuit").fill_null(0)))


def _usual_order(df: pl.DataFrame) -> pl.DataFrame:
    """Rows of a per metric x space frame in the usual order of metrics, then spaces (a page says the same every build)."""
    usual = {c: i for i, c in enumerate((m, s) for m in METRICS for s in SPACES)}
    return df.with_columns(o=pl.struct("metric", "space").map_elements(
        lambda r: usual.get((r["metric"], r["space"]), len(usual)), return_dtype=pl.Int64)).sort("o", "metric", "space").drop("o")


def lead_cell(counts: pl.DataFrame, fallback: tuple[str, str]) -> tuple[str, str]:
    """The metric x space a model's page opens on (``LEAD_RULE``). ``counts``: per metric x space,
    ``k`` (its K-composition discoveries) and ``circuit`` (those from a previous-token head into
    an induction head: ``circuit_counts``). The most circuit edges; ties go to the larger share
    circuit / k, then to ``fallback``, then to the usual order of metrics and spaces. Where no
    metric x space has a circuit edge: ``fallback`` (the metric audit's lead, ``heatmaps.lead_combo``).

    Why not the metric audit's lead alone: the one metric x space that satisfies all four axioms
    can find none of a model's induction circuit (SmolLM2's subspace x token finds 6 V
    discoveries L23/24 -> L29 and no K edge into an induction head), and the page then opened on
    them and hid the circuit."""
    found = counts.filter(pl.col("circuit") > 0)
    if found.is_empty():
        return fallback
    usual = [(m, s) for m in METRICS for s in SPACES]
    rank = {c: i for i, c in enumerate([fallback, *(c for c in usual if c != fallback)])}
    best = min(found.iter_rows(named=True),
               key=lambda r: (-r["circuit"], -r["circuit"] / max(r["k"], r["circuit"], 1),
                              rank.get((r["metric"], r["space"]), len(rank)), r["metric"], r["space"]))
    return best["metric"], best["space"]


def lead_sentence(counts: pl.DataFrame, lead: tuple[str, str]) -> str:
    """Why the page opens on ``lead``: the rule, and its numbers for this model (HTML)."""
    m, s = (html.escape(x) for x in lead)
    at = (pl.col("metric") == lead[0]) & (pl.col("space") == lead[1])
    row = counts.filter(at)
    n = int(row["circuit"][0]) if row.height else 0
    if not n:
        return (f"The menu opens on <b>{m} · {s}</b>, by the rule: {LEAD_RULE}. This model has no K discovery "
                "from a previous-token head into an induction head in any metric · space.")
    others = [f"{html.escape(r['metric'])} · {html.escape(r['space'])} ({n:,} of {r['k']:,})"
              for r in _usual_order(counts.filter((pl.col("circuit") == n) & ~at)).iter_rows(named=True)]
    tied = ("" if not others else f"; as many in {', '.join(others)}" if len(others) <= 3 else
            f"; as many in {len(others)} other metric · spaces, e.g. {', '.join(others[:2])}")
    return (f"The menu opens on <b>{m} · {s}</b>, by the rule: {LEAD_RULE}. Here {n:,} of its {int(row['k'][0]):,} "
            f"K discoveries are such edges{tied}.")


def node_frame(n_layers: int, n_heads: int, heads: pl.DataFrame, prev_cut: float, ind_cut: float) -> pl.DataFrame:
    """Every head with its role from the head scores (when there are any)."""
    nodes = pl.DataFrame({"layer": [l for l in range(n_layers) for _ in range(n_heads)],
                          "head": [h for _ in range(n_layers) for h in range(n_heads)]})
    if heads.is_empty():
        return nodes.with_columns(role=pl.lit(OTHER), prev_token=pl.lit(None, pl.Float64),
                                  induction=pl.lit(None, pl.Float64))
    hs = heads.select("layer", "head", pl.col("prev_token_mean").alias("prev_token"),
                      pl.col("induction_mean").alias("induction")).cast({"layer": pl.Int64, "head": pl.Int64})
    nodes = nodes.join(hs, on=["layer", "head"], how="left")
    return nodes.with_columns(role=pl.when(pl.col("induction") >= ind_cut).then(pl.lit(IND))
                              .when(pl.col("prev_token") >= prev_cut).then(pl.lit(PREV)).otherwise(pl.lit(OTHER)))


CURVE_POINTS = 9  # points along each edge's curve
NOTE_PX = 11  # font size of an empty panel's note

# What a curve is, each drawn in its own dash: a discovery; where a model has none, one of its
# smallest-p pairs; in a magnitude metric (contribution: its heavy-tailed null gives it no
# discoveries, yet its largest K scores are the circuit), one of its largest scores
DISCOVERY, SMALLEST_P, LARGEST = "discovery", "smallest p (no discoveries)", "largest score (a magnitude)"
KIND_DASH: dict[str, list[float]] = {DISCOVERY: [1, 0], SMALLEST_P: [6, 3], LARGEST: [2, 4]}  # butt caps: a wide dot stays one

# Each edge a quadratic Bezier from writer (head, layer) to reader through a control point
# (cx, cy) a head aside of the middle, drawn by Vega from the edge's one row (``edge_rows``)
# at t = 0, 1/8, ..., 1: the points are never shipped, nor the edge's fields repeated per point.
CURVE_X = "pow(1 - datum.t, 2) * datum.wh + 2 * (1 - datum.t) * datum.t * datum.cx + pow(datum.t, 2) * datum.rh"
CURVE_Y = "pow(1 - datum.t, 2) * datum.wl + 2 * (1 - datum.t) * datum.t * datum.cy + pow(datum.t, 2) * datum.rl"
EDGE_COLUMNS = {"eid": pl.Int64, "combo": pl.Utf8, "comp": pl.Utf8, "kind": pl.Utf8, "wl": pl.Int64, "wh": pl.Int64,
                "rl": pl.Int64, "rh": pl.Int64, "cx": pl.Float64, "cy": pl.Float64, "score": pl.Float64,
                "null_mean": pl.Float64, "z": pl.Float64, "n_null": pl.Int64, "p": pl.Float64, "q": pl.Float64}


def edge_rows(e: pl.DataFrame) -> pl.DataFrame:
    """One row per edge (``EDGE_COLUMNS``): its metric x space (``combo``), comp, kind (``KIND_DASH``),
    heads, score, null, p and q, and its curve's control point (cx, cy): half way, bowed a head
    outwards from the writer's column (straight-down edges alternate sides by layer), so that an
    edge does not run through the heads of the layers between its ends and edges between the
    same heads in different comps or layers part. ``CURVE_X`` / ``CURVE_Y`` give its points."""
    if e.is_empty():
        return pl.DataFrame(schema=EDGE_COLUMNS)
    wh, rh, wl, rl = (pl.col(c).cast(pl.Int64) for c in ("writer_head", "reader_head", "writer_layer", "reader_layer"))
    side = pl.when(rh > wh).then(1.0).when(rh < wh).then(-1.0).when(wl % 2 == 0).then(1.0).otherwise(-1.0)
    kind = pl.col("kind") if "kind" in e.columns else pl.lit(DISCOVERY)
    return e.with_row_index("eid").select(
        pl.col("eid").cast(pl.Int64), combo=pl.col("metric") + " · " + pl.col("space"), comp="comp", kind=kind,
        wl=wl, wh=wh, rl=rl, rh=rh, cx=(wh + rh) / 2 + side, cy=(wl + rl) / 2, score="score",
        null_mean="baseline_spectrum_mean", z="z_spectrum", n_null=pl.col("n_null").cast(pl.Int64), p="p_value",
        q="q_value").cast(EDGE_COLUMNS)  # type: ignore[arg-type]


def empty_panels(e: pl.DataFrame, combos: list[str], comps: list[str], found: dict[tuple[str, str], int],
                 candidates: bool) -> pl.DataFrame:
    """One row per metric x space (``combo``) x comp whose panel has no curve, with ``text``, why:
    no discoveries there (``found``: discoveries per (combo, comp), from the calibration summary),
    or, where the comp has some, that the drawn ones (the smallest q of the metric x space, all
    comps together) left it none; with ``candidates``, that no pair was drawn."""
    drawn = {(r["combo"], r["comp"]) for r in e.select("combo", "comp").unique().iter_rows(named=True)}
    rows = []
    for combo in combos:
        for comp in comps:
            if (combo, comp) in drawn:
                continue
            n = found.get((combo, comp), 0)
            # short lines: a panel of a two-head model is 160 px wide
            text = (f"no pair drawn\nin {comp} for this\nmetric · space" if candidates else
                    f"no discoveries\nin {comp} for this\nmetric · space" if not n else
                    f"{n:,} discoveries\nin {comp}, none among\nthe {EDGE_MAX} drawn\n(smallest q,\nall comps)")
            rows.append({"combo": combo, "comp": comp, "text": text})
    return pl.DataFrame(rows, schema={"combo": pl.Utf8, "comp": pl.Utf8, "text": pl.Utf8})


def circuit_chart(edges: pl.DataFrame, nodes: pl.DataFrame, model: str, checkpoint: str, lead: tuple[str, str],
                  q_cut: float | None, candidates: bool = False,
                  combos_scored: list[tuple[str, str]] | None = None,
                  summary: pl.DataFrame | None = None) -> alt.HConcatChart:
    """One panel per comp (Q, K, V side by side, so their edges never lie on top of each other),
    each edge a curve (``edge_rows``). ``edges``: queries.discoveries of the model x checkpoint (any
    metric x space), or with ``candidates`` queries.strongest (there are no discoveries), and a
    magnitude metric's largest scores, each row's ``kind`` saying which (``KIND_DASH``: drawn in
    its own dash, said so). The dropdown (the Vega parameter ``combo``, "metric · space") lists every
    metric x space scored (``combos_scored``) with its number of discoveries, none left out for
    having none, and opens on ``lead``. A panel with no curve for the chosen metric x space says
    why (``empty_panels``; ``summary``: queries.calibration_summary, its discoveries per comp).
    The edges are one dataset, a row each; the legend of their width is drawn from the picked
    metric x space's own scores (a magnitude's, in its own units, set the scale of every other's)."""
    n_layers, n_heads = integer(nodes["layer"].max()) + 1, integer(nodes["head"].max()) + 1
    if edges.width and "kind" not in edges.columns:
        edges = edges.with_columns(kind=pl.lit(SMALLEST_P if candidates else DISCOVERY))
    rows = edge_rows(edges)
    scored = [f"{m} · {s}" for m, s in (combos_scored or [])] or sorted(set(rows["combo"]))
    combos = [f"{m} · {s}" for m in METRICS for s in SPACES if f"{m} · {s}" in scored] + sorted(
        set(scored) - {f"{m} · {s}" for m in METRICS for s in SPACES})
    found = {} if summary is None or summary.is_empty() or "discoveries" not in summary.columns else {
        (f"{r['metric']} · {r['space']}", r["comp"]): int(r["discoveries"] or 0) for r in summary.iter_rows(named=True)}
    kinds = [k for k in KIND_DASH if k in set(rows["kind"])]
    magnitude = sorted(set(rows.filter(pl.col("kind") == LARGEST)["combo"]))
    default = f"{lead[0]} · {lead[1]}"

    per_combo = {c: sum(v for (cc, _), v in found.items() if cc == c) for c in combos}  # the discoveries view's count

    def label(c: str) -> str:
        n = per_combo[c]
        if c in magnitude:
            return f"{c} (a magnitude: its largest scores, not discoveries; {n:,} discoveries)"
        return f"{c} ({'no discoveries' if not n or candidates else f'{n:,} discoveries'})"

    pick = alt.param(name="combo", value=default if default in combos else (combos[0] if combos else default),
                     bind=alt.binding_select(options=combos or [default], labels=[label(c) for c in combos] or alt.Undefined,
                                             name="metric · space: "))
    # every comp gets its panel, with or without curves: an empty one says why (``empty_panels``)
    comps = order([*rows["comp"].unique().to_list(), *COMPS], COMPS)
    empty = empty_panels(rows, combos, comps, found, candidates)
    panel_w = max(160, min(46 * n_heads + 40, (CONTENT - 330) // len(comps)))  # room for axes and legends
    height = min(900, max(200, 30 * n_layers))
    xs = alt.Scale(domain=[-1, n_heads], nice=False)
    ys = alt.Scale(domain=[n_layers - 0.5, -0.5], nice=False)
    x = alt.X("head:Q", scale=xs, axis=alt.Axis(title="head", values=list(range(n_heads)), format="d", grid=False))
    y = alt.Y("layer:Q", scale=ys, axis=alt.Axis(title="layer", values=list(range(n_layers)), format="d", grid=True,
                                                 gridOpacity=0.3, labelOverlap=True))
    roles = [PREV, IND, OTHER]
    points = alt.Chart(nodes).mark_circle(stroke="#333", strokeWidth=0.5, opacity=1).encode(
        x=x, y=y, size=alt.value(max(20, min(140, 6000 // max(n_heads * n_layers, 1) + 20))),
        color=alt.Color("role:N", scale=alt.Scale(domain=roles, range=["#f58518", "#b279a2", "#e8e8e8"]),
                        legend=alt.Legend(title="head (behaviour)", orient="right")),
        tooltip=[alt.Tooltip("layer:Q"), alt.Tooltip("head:Q"), "role:N",
                 alt.Tooltip("prev_token:Q", title="previous-token score", format=".2f"),
                 alt.Tooltip("induction:Q", title="induction score", format=".2f")])
    # the width's domain: the picked metric x space's own scores, [smallest, largest] of its drawn
    # edges (a magnitude's, in its own units, set every metric's scale once); its labels with the
    # digits its ticks need (".3f" read "0.287" five times, and one edge's 0.9 read "1"); a metric x
    # space with no edge draws no legend
    ranges = {c: [number(g["score"].min()), number(g["score"].max())] for (c,), g in rows.group_by("combo")}
    known = json.dumps(ranges, sort_keys=True, ensure_ascii=False)
    has, seen = f"isValid({known}[combo])", alt.ExprRef(expr=f"isValid({known}[combo]) ? 1 : 0")
    width = alt.StrokeWidth("score:Q", scale=alt.Scale(zero=False, range=[0.8, 4.5], domain=alt.ExprRef(
        expr=f"{has} ? {known}[combo] : [0, 1]")), legend=alt.Legend(
        title="score", labelExpr="format(datum.value, '.6~g')", labelOpacity=seen, symbolOpacity=seen, titleOpacity=seen))
    dash = alt.StrokeDash("kind:N", scale=alt.Scale(domain=kinds or [DISCOVERY], range=[KIND_DASH[k] for k in kinds or [DISCOVERY]]),
                          # a legend only where one metric x space draws curves of two kinds: each menu entry
                          # draws one kind, which its label names (a legend of every kind listed curves not drawn)
                          legend=alt.Legend(title="curve", symbolType="stroke", symbolStrokeWidth=2, symbolSize=300)
                          if rows.height and number(rows.group_by("combo").agg(pl.col("kind").n_unique())["kind"].max()) > 1 else None)
    panels = []
    for comp in comps:
        link = (alt.Chart(rows, name=f"edges_{comp}")
                .transform_filter(f"datum.combo == combo && datum.comp == '{comp}'")
                .transform_calculate(i=f"sequence(0, {CURVE_POINTS})").transform_flatten(["i"])
                .transform_calculate(t=f"datum.i / {CURVE_POINTS - 1}")
                .transform_calculate(x=CURVE_X, y=CURVE_Y, writer="'L' + datum.wl + '.H' + datum.wh",
                                     reader="'L' + datum.rl + '.H' + datum.rh")
                .mark_line(strokeCap="butt", interpolate="linear", color=COMP_COLOURS.get(comp, "#888"), opacity=0.75)
                .encode(x=alt.X("x:Q", scale=xs), y=alt.Y("y:Q", scale=ys), detail="eid:N", order="t:Q",
                        strokeWidth=width, strokeDash=dash,
                        tooltip=[alt.Tooltip("writer:N"), alt.Tooltip("reader:N"), "comp:N", alt.Tooltip("kind:N", title="curve"),
                                 alt.Tooltip("score:Q", format=".4~g"),
                                 alt.Tooltip("null_mean:Q", title="spectrum-kept null mean", format=".4~g"),
                                 alt.Tooltip("z:Q", title="z", format=".1f"),
                                 alt.Tooltip("n_null:Q", title="non-causal null pairs", format=","),
                                 alt.Tooltip("p:Q", title="p", format=".3~e"), alt.Tooltip("q:Q", title="q", format=".4~g")]))
        # the words on a white box over the heads' dots and grid lines, sized from them in the panel's units
        px_x, px_y = panel_w / (n_heads + 1), height / n_layers
        cx, cy = (n_heads - 1) / 2, (n_layers - 1) / 2
        box = empty.filter(pl.col("comp") == comp).with_columns(
            half_w=(pl.col("text").str.split("\n").list.eval(pl.element().str.len_chars()).list.max() * NOTE_PX * 0.33
                    + 8) / px_x,
            half_h=((pl.col("text").str.count_matches("\n") + 1) * NOTE_PX * 1.3 / 2 + 5) / px_y,
            # Vega sets a text's first line at y: the block's middle goes at the box's
            lift=pl.col("text").str.count_matches("\n") * NOTE_PX * 1.3 / 2 / px_y,
        ).with_columns(x=pl.lit(cx), y=cy - pl.col("lift"), x0=cx - pl.col("half_w"), x1=cx + pl.col("half_w"),
                       y0=cy - pl.col("half_h"), y1=cy + pl.col("half_h"))
        why = alt.Chart(box).transform_filter("datum.combo == combo")
        back = why.mark_rect(fill="white", stroke="#bbb", opacity=0.95).encode(
            x=alt.X("x0:Q", scale=xs), x2="x1:Q", y=alt.Y("y0:Q", scale=ys), y2="y1:Q")
        words = why.mark_text(lineBreak="\n", fontSize=NOTE_PX, lineHeight=NOTE_PX * 1.3, baseline="middle",
                              color="#555", fontStyle="italic").encode(
            x=alt.X("x:Q", scale=xs), y=alt.Y("y:Q", scale=ys), text="text:N")
        panels.append(alt.layer(link, points, back, words).properties(width=panel_w, height=height, title=alt.TitleParams(
            f"{comp}-composition", color=COMP_COLOURS.get(comp, "#333"), fontSize=13, anchor="middle")))
    cap = 0 if candidates else max((n for c, n in per_combo.items() if c not in magnitude), default=0)
    fdr = q_cut if q_cut is not None else "fdr"
    what = []
    if SMALLEST_P in kinds:
        what.append(f"No pair is a discovery (q <= {fdr}): dashed curves are the {STRONGEST_PER_COMP} smallest-p pairs per "
                    "metric · space and comp (a key/value head's drawn to each of its query heads), NOT a circuit.")
    if DISCOVERY in kinds or not kinds:
        what.append(f"Curves: the discoveries (q <= {fdr}), writer head (upper) to reader head in a later layer, one panel "
                    "per comp, thicker for a higher score" + (f"; of the {cap:,} discoveries, the {EDGE_MAX} with the "
                                                             "smallest q" if cap > EDGE_MAX else "") + ".")
    if LARGEST in kinds:
        names = sorted({c.split(" · ")[0] for c in magnitude})
        what.append(f"{', '.join(names)} {'is a magnitude' if len(names) == 1 else 'are magnitudes'} (in its own units; a "
                    f"heavy-tailed null leaves it few discoveries or none): dotted curves are its {STRONGEST_PER_COMP} "
                    "largest scores per comp, not discoveries.")
    return alt.hconcat(*panels, spacing=12).add_params(pick).properties(title=alt.TitleParams(
        f"{model} @ {checkpoint}: the circuit its weights show", anchor="start", fontSize=14, subtitleColor="#444",
        subtitle=wrap(what + ["Nodes: every head, coloured by what it does on repeated random tokens (head scores). "
                              "The menu lists every metric · space with its number of discoveries."], font_px=10)))
