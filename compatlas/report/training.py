"""Training as trajectories (docs/math.md#composition-over-training): for a model with a
checkpoint series, the loss, the eventual heads' scores and induction strength, and the
eventual pair's composition on one figure over one step axis, with the formation (or
loss-drop) step marked; and the overview's one line per run."""

from __future__ import annotations

import html

import altair as alt
import polars as pl

from compatlas.behaviour import formation as fm
from compatlas.behaviour.formation import TrainingOutcome
from compatlas.report.page import head, note, step, table
from compatlas.tables import number
from compatlas.vocab import COMPS, METRICS, NORMALISED_METRICS, SPACES

PANEL_W = 1060


def log_axis(steps: pl.Series) -> bool:
    """A log step axis when the checkpoints are log-spaced early on (the first step after 0 under a
    twentieth of the last, as Pythia's 1, 2, 4, ...); evenly spaced ones read better linearly."""
    positive = steps.filter(steps > 0)
    return positive.len() > 0 and number(positive.min()) < number(positive.max()) / 20


def step_x(top: float, log: bool, title: str | None = "training step") -> alt.X:
    """The step axis every panel shares over [0, top]: symlog (step 0, the initialisation, and the
    log-spaced early checkpoints both visible; ticks at 0 and the powers of ten) or linear."""
    if not log:
        return alt.X("step:Q", scale=alt.Scale(domain=[0, top], nice=False),
                     axis=alt.Axis(title=title, format=",d", grid=True, tickCount=8))
    ticks = sorted({0, int(top)} | {10 ** k for k in range(len(str(int(max(top, 1))))) if 10 ** k < top / 1.5})
    return alt.X("step:Q", scale=alt.Scale(type="symlog", constant=1, domain=[0, top], nice=False),
                 axis=alt.Axis(title=title, values=ticks, format=",d", grid=True))


def _rule(chart: alt.Chart, marker: float | None) -> alt.Chart | alt.LayerChart | alt.FacetChart:
    if marker is None:
        return chart
    rule = alt.Chart(pl.DataFrame({"step": [marker]})).mark_rule(color="black", strokeDash=[4, 3]).encode(x="step:Q")
    return alt.layer(chart, rule)


def trajectory_chart(t: TrainingOutcome, strength: pl.DataFrame, model: str) -> alt.VConcatChart:
    """Loss; the eventual heads' scores and the mean induction strength; the pair's composition
    per comp (colour = metric, dash = space). All on the same step axis (``log_axis``)."""
    assert t.pair is not None  # the model's page draws this only for a model with a pair to follow
    (il, ih), (pl_, ph) = t.pair
    heads = t.heads
    ind = heads.filter((pl.col("layer") == il) & (pl.col("head") == ih))
    prev = heads.filter((pl.col("layer") == pl_) & (pl.col("head") == ph))
    beh = pl.concat([ind.select("step", pl.lit(f"induction score of {head(il, ih)}").alias("series"),
                                pl.col("induction_mean").alias("value")),
                     prev.select("step", pl.lit(f"previous-token score of {head(pl_, ph)}").alias("series"),
                                 pl.col("prev_token_mean").alias("value"))]).cast({"step": pl.Float64})
    top = number(heads["step"].max())
    log = log_axis(heads["step"])
    panels: list[alt.Chart | alt.LayerChart | alt.FacetChart] = []
    magnitudes: list[str] = []
    if t.loss.height:
        w = max(1, t.loss.height // 300)  # bin to about 300 points
        loss = t.loss.with_columns(b=(pl.col("step") - 1) // w).group_by("b").agg(pl.col("step").max(), pl.col("loss").mean()).sort("step")
        panels.append(_rule(alt.Chart(loss).mark_line(color="#555").encode(
            x=step_x(top, log), y=alt.Y("loss:Q", title="training loss", scale=alt.Scale(zero=False)),
            tooltip=[alt.Tooltip("step:Q", format=","), alt.Tooltip("loss:Q", format=".3f")]).properties(
            width=PANEL_W, height=110), t.marker))
    panels.append(_rule(alt.Chart(beh).mark_line(point=True).encode(
        x=step_x(top, log), y=alt.Y("value:Q", title="attention score", scale=alt.Scale(domain=[0, 1])),
        color=alt.Color("series:N", title=None, legend=alt.Legend(orient="top-left")),
        tooltip=["series:N", alt.Tooltip("step:Q", format=","), alt.Tooltip("value:Q", format=".3f")]).properties(
        width=PANEL_W, height=130), t.marker))
    if not strength.is_empty():
        panels.append(_rule(alt.Chart(strength).mark_line(point=True, color="#c44e52").encode(
            x=step_x(top, log), y=alt.Y("strength:Q", title="induction strength"),
            tooltip=[alt.Tooltip("step:Q", format=","), alt.Tooltip("strength:Q", format=".3f")]).properties(
            width=PANEL_W, height=90), t.marker))
    if not t.curves.is_empty():
        comps = [c for c in COMPS if c in set(t.curves["comp"])]
        w = (PANEL_W - 30 * (len(comps) - 1) - 120) // max(len(comps), 1)
        # the normalised scores share [0, 1]; a magnitude (contribution) in its own units would flatten them
        c = (t.curves.filter(pl.col("metric").is_in(NORMALISED_METRICS))
             .with_columns(marker=pl.lit(t.marker)).cast({"step": pl.Float64}))
        magnitudes = sorted(set(t.curves["metric"]) - set(NORMALISED_METRICS))
        layers = [alt.Chart().mark_line(point=alt.OverlayMarkDef(size=18)).encode(
            x=step_x(top, log), y=alt.Y("score:Q", title=f"score of {head(pl_, ph)} → {head(il, ih)}",
                                        scale=alt.Scale(domain=[0, 1])),
            color=alt.Color("metric:N", sort=list(METRICS), legend=alt.Legend(symbolType="stroke", symbolStrokeWidth=2.5)),
            # the legend draws the dash as a line: as points it showed two identical dots
            # (with the points overlaid, the symbol needs a fill colour too, or Vega draws it blank)
            strokeDash=alt.StrokeDash("space:N", sort=list(SPACES), legend=alt.Legend(
                symbolType="stroke", symbolStrokeWidth=2, symbolSize=200, symbolStrokeColor="#333",
                symbolFillColor="#333", symbolOpacity=1)),
            tooltip=["metric", "space", "comp", alt.Tooltip("step:Q", format=","), alt.Tooltip("score:Q", format=".3f"),
                     alt.Tooltip("q_value:Q", title="q", format=".2e")])]
        if t.marker is not None:
            layers.append(alt.Chart().mark_rule(color="black", strokeDash=[4, 3]).encode(x="marker:Q"))
        panels.append(alt.layer(*layers, data=c).properties(width=w, height=150).facet(
            column=alt.Column("comp:N", sort=comps, title=None, header=alt.Header(labelExpr="datum.value + '-composition'"))))
    marker = ("formation step" if t.formation is not None else "loss-drop step") if t.marker is not None else None
    return alt.vconcat(*panels, spacing=8).resolve_scale(color="independent", strokeDash="independent").properties(
        title=alt.TitleParams(f"{model}: the circuit forming over training", anchor="start", subtitleColor="#444",
                              subtitle=[("Checkpoint step on a log axis (step 0 at the left)" if log else "Checkpoint step")
                                        + (f"; dashed: the {marker} ({step(t.marker)})." if marker else ".")]
                              + ([f"Composition panels: the normalised scores; {', '.join(magnitudes)} (a magnitude, in "
                                  "its own units) is in the table below."] if magnitudes else [])))


def describe(t: TrainingOutcome) -> str:
    assert t.pair is not None  # as trajectory_chart: only for a model with a pair
    (il, ih), (pl_, ph) = t.pair
    s = (f"Eventual induction head <b>{head(il, ih)}</b> (highest induction score at the last checkpoint), eventual "
         f"previous-token head <b>{head(pl_, ph)}</b> (highest previous-token score in an earlier layer). ")
    if t.formation is not None:
        s += (f"Formation step <b>{step(t.formation)}</b>: where {head(il, ih)}'s induction score crosses the midpoint of "
              "its first and final values.")
        if t.drop is not None:
            s += f" The training loss falls fastest at step <b>{step(t.drop)}</b>."
    else:
        s += (f"<b>No canonical induction head forms</b>: {head(il, ih)}'s induction score rises by less than "
              f"{fm.MIN_RISE}." + (f" The curves are judged against the loss-drop step <b>{step(t.drop)}</b>."
                                   if t.drop is not None else ""))
    return f"<p>{s}</p>"


def by_comp(v: pl.DataFrame) -> dict[str, str]:
    """Curves named compactly, per comp: ``{"K": "frobenius (residual, token); svd_bound (residual)"}``."""
    out: dict[str, str] = {}
    for comp in [c for c in COMPS if c in set(v["comp"])]:
        g = v.filter(pl.col("comp") == comp)
        out[comp] = "; ".join(f"{m} ({', '.join(s for s in SPACES if s in set(g.filter(pl.col('metric') == m)['space']))})"
                              for m in METRICS if m in set(g["metric"]))
    return out


def verdict_summary(v: pl.DataFrame) -> str:
    """Which curves track the formation and which rise early: one line per comp, not a sentence."""
    rows = []
    for label, part in (("tracks the formation", fm.tracking(v)), ("rises early", v.filter(pl.col("rises_early")))):
        named = by_comp(part)
        rows.append([f"<b>{label}</b> ({part.height} of {v.height} curves)",
                     *(html.escape(named.get(c, "–")) for c in COMPS)])
    return table(["", *[f"{c}-composition" for c in COMPS]], rows, cls="finds", raw=True)


def verdict_table(t: TrainingOutcome) -> str:
    v = t.verdicts
    if v is None:
        return ""
    rows = [[r["metric"], r["space"], r["comp"], r["before_formation"], r["final"], step(r["largest_rise_at"]),
             r["early_max"], r["tracks"], r["rises_early"]] for r in v.sort("comp", "metric", "space").iter_rows(named=True)]
    return (verdict_summary(v)
            + note("Tracks: ends above its value before the formation, with its largest rise between consecutive "
                   "checkpoints at (or next to) the formation step. Rises early: before half the formation step "
                   "(initialisation excluded) it already reaches its final value.")
            + table(["metric", "space", "comp", "before formation", "final", "largest rise at step", "early max",
                     "tracks", "rises early"], rows))


def runs_table(outcomes: dict[str, TrainingOutcome], link) -> str:
    """Overview: one line per model with a checkpoint series."""
    rows = []
    for model, t in outcomes.items():
        name = link(model)
        if t.pair is None:
            rows.append([name, "(one layer)", "", "–", step(t.drop), ""])
            continue
        (il, ih), (pl_, ph) = t.pair
        last = t.heads.filter(pl.col("step") == t.heads["step"].max())
        score = {(r["layer"], r["head"]): r for r in last.iter_rows(named=True)}
        tracks = "" if t.verdicts is None else "<br>".join(
            f"{c}: {html.escape(s)}" for c, s in by_comp(fm.tracking(t.verdicts)).items())
        rows.append([name, f"{head(il, ih)} ({score[(il, ih)]['induction_mean']:.2f})",
                     f"{head(pl_, ph)} ({score[(pl_, ph)]['prev_token_mean']:.2f})", step(t.formation), step(t.drop),
                     tracks or "none"])
    return ("<h2 id='training'>Composition over training</h2>"
            + note("Per model with a checkpoint series: the eventual induction and previous-token heads (final "
                   "scores), the formation step, the steepest loss drop, and the composition curves of the pair that "
                   "track the formation without rising early (trajectories on the model's page).")
            + table(["model", "induction head", "previous-token head", "formation step", "loss-drop step",
                     "tracks the formation"], rows, raw=True))
