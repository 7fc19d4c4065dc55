"""The top-discovery tables of a model's page: one row per distinct finding (in a grouped-query
model a K or V finding is one key/value head's, repeated for each query head that shares it),
and, where the numbers are, what the null's floor p = 1 / (N + 1) means for them and where the
tail model takes p below it; a magnitude metric's largest scores, said to be no discoveries."""

from __future__ import annotations

import html

import polars as pl

from compatlas.report import queries as q
from compatlas.report.circuit import LARGEST
from compatlas.report.page import fmt, fmt_q, head, note, table
from compatlas.tables import integer
from compatlas.vocab import COMPS

TOP_N = 10  # findings per comp


def kv_group(info: dict) -> int:
    """Query heads per key/value head (1 without grouped-query attention)."""
    n, kv = info.get("n_heads") or 1, info.get("n_kv_heads") or info.get("n_heads") or 1
    return max(1, int(n) // max(1, int(kv)))


def why_none(summary: pl.DataFrame, q_cut: float | None) -> str | None:
    """Why a model can have no discoveries at all, in a few words, or None when it can: its
    atlas has no calibration, or its null of N pairs is too small (the smallest p, 1/(N+1), is
    above the false discovery rate: the trained 2-layer, 2-head model's N = 4 gives 1/5)."""
    if summary.is_empty():
        return None
    if q_cut is None or "n_null" not in summary.columns or summary["n_null"].is_null().all():
        return "not calibrated (no p-values in this atlas)"
    n = integer(summary["n_null"].max())
    if 1 / (n + 1) > q_cut:
        return (f"none possible: its null has {n:,} pairs, so the smallest p is 1/{n + 1:,} = {fmt(1 / (n + 1))}, "
                f"above the false discovery rate {q_cut:g}")
    return None


def findings(edges: pl.DataFrame, group: int, by_score: bool = False) -> pl.DataFrame:
    """One row per finding: rows with the same comp, writer, reader layer, reader KV head
    (``reader_head // group``), score, p and q are one finding, shared by the query heads in
    ``readers``. Smallest q first (ties: smaller p, then larger score); ``by_score``: largest score first."""
    keys = ["comp", "writer_layer", "writer_head", "reader_layer", "kv", "score", "p_value", "q_value"]
    return (edges.with_columns(kv=pl.col("reader_head") // group)
            .group_by(keys, maintain_order=True)
            .agg(pl.col("reader_head").sort().alias("readers"), pl.col("baseline_spectrum_mean").first(),
                 pl.col("z_spectrum").first())
            .sort(["score", "q_value"] if by_score else ["q_value", "p_value", "score"],
                  descending=[True, False] if by_score else [False, False, True]))


def readers_cell(layer: int, readers: list[int]) -> str:
    """``L17.H3`` or, for query heads sharing a finding, ``L17.H3, H4, H5``."""
    return head(layer, readers[0]) + "".join(f", H{h}" for h in readers[1:])


def floor_summary(con: q.Con, model: str, checkpoint: str, group: int) -> pl.DataFrame:
    """Per metric x space x comp: ``m`` (the tests Benjamini-Hochberg counted), ``n_null``,
    ``k`` (tests beyond every null pair: p at most the counting floor 1 / (n_null + 1)), of them
    ``k_tail`` (p below the floor: the tail model's) with the smallest p ``p_min``, and ``q_k``
    (the largest q among the k). A row is its own test unless the calibration says a KV head's
    test is shared by its ``group`` query heads (``test_unit``): then one row stands for it.
    Every metric x space in one scan: the page has a table (and this note) for each."""
    if not q.has(con, "calibration", "p_value", "q_value", "n_null"):
        return pl.DataFrame()
    one = (f"(test_unit IS DISTINCT FROM 'kv_head' OR reader_head % {int(group)} = 0)"
           if "test_unit" in q.columns(con, "calibration") else "true")
    beyond = "p_value <= (1 + 1e-9) / (n_null + 1)"  # the floor, or the tail model's p below it
    summary = q._pl(con, f"""SELECT metric, space, comp, count(*) AS m, max(n_null)::BIGINT AS n_null,
                               count_if({beyond})::BIGINT AS k, max(q_value) FILTER (WHERE {beyond}) AS q_k,
                               count_if(p_value < (1 - 1e-9) / (n_null + 1))::BIGINT AS k_tail, min(p_value) AS p_min
                        FROM calibration WHERE model = ? AND checkpoint = ? AND {one}
                        GROUP BY ALL""", [model, checkpoint])
    if summary.height and q.has(con, "discovery_floor", "set_by_floor"):  # the discoveries' share of the floor
        floor = q._pl(con, """SELECT metric, space, comp, n_discoveries, n_at_floor, n_below_floor, q_at_floor, q_one_fewer,
                                     set_by_floor FROM discovery_floor WHERE model = ? AND checkpoint = ?""", [model, checkpoint])
        summary = summary.join(floor, on=["metric", "space", "comp"], how="left")
    return summary


def floor_note(floor: pl.DataFrame, q_cut: float | None) -> str:
    """What p at or below the null's floor 1 / (N + 1) means, with this cell's numbers: per comp
    with tests beyond every null pair, how many, how many chance alone would put there
    (m / (N + 1)), how many sit at the floor and what their q then says, and how many the tail
    model puts further out (p below the floor: the counting floor holds only below the null's
    largest score, calibration.empirical_p_values)."""
    if floor.is_empty() or q_cut is None:
        return ""
    parts = []
    for r in floor.sort("comp").iter_rows(named=True):
        m, n, k = r["m"], r["n_null"], r["k"]
        if not k or not n or 1 / (n + 1) > q_cut:
            continue
        tail = int(r.get("k_tail") or 0)
        chance = m / (n + 1)
        text = (f"<b>{html.escape(r['comp'])}</b>: {k:,} of the {m:,} tests score above every one of the N = {n:,} "
                f"null pairs, where chance alone would put about m/(N+1) = {fmt(chance)}")
        if k > tail:
            sit = "sits" if k - tail == 1 else "sit"
            text += (f"; {k - tail:,} of them {sit} at the floor 1/(N+1) = {fmt(1 / (n + 1))}, where q is about "
                     f"{fmt(chance)}/{k:,} = {fmt_q(chance / k, q_cut)} (largest q among the {k:,}: {fmt_q(r['q_k'], q_cut)}): of those, "
                     f"about {fmt(chance)} {'is' if round(chance) == 1 else 'are'} expected by chance")
        if tail:
            text += (f"; {tail:,} {'lies' if tail == 1 else 'lie'} far enough beyond the null's largest score for its "
                     "tail model to give a p below "
                     f"the floor (down to {fmt(r.get('p_min'))})")
        text += "." + discoveries_at_floor(r, q_cut)
        parts.append(text)
    if not parts:
        return ""
    ns = sorted({int(n) for n in floor["n_null"].drop_nulls()})
    # a KV head's tests have a smaller null (one test per writer x KV head) than a query head's
    bound = f"1/(N+1) = 1/{ns[0] + 1:,} = {fmt(1 / (ns[0] + 1))}" if len(ns) == 1 else "1/(N+1) (N per comp below)"
    return note(f"<b>p at the null's floor:</b> with N null pairs the counting p, (1 + #null pairs scoring as high)/(N+1), "
                f"cannot go below {bound}; it is the p of every pair below the null's largest score. Beyond that "
                "score the null's tail is modelled (a generalised Pareto fit to its largest scores, its shape at the "
                "upper end of its 95% interval, so that p errs large: docs/statistics.md) and p is the smaller of the "
                "floor and the model's: a p at the floor is a pair beyond every null pair that the model puts no "
                "further out, a p below it the model's. What the pairs beyond every null pair show is their number "
                "against chance. " + " ".join(parts))


def discoveries_at_floor(r: dict, q_cut: float) -> str:
    """Of a comp's discoveries, how many sit at the floor, and whether their count is the floor's
    (the ``discovery_floor`` view): with one test fewer at or below the floor, would they still pass?"""
    d, at = r.get("n_discoveries") or 0, r.get("n_at_floor") or 0
    if not d or r.get("q_one_fewer") is None:
        return ""
    text = (f" Of its {d:,} discoveries, {at:,} {'sits' if at == 1 else 'sit'} at the floor and "
            f"{r.get('n_below_floor') or 0:,} below it; ")
    if not at:
        return text + "none rests on the floor."
    text += (f"a test at the floor has q = {fmt_q(r['q_at_floor'], q_cut)}, and with one test fewer at or below the floor "
             f"it would have {fmt_q(r['q_one_fewer'], q_cut)}")
    if r.get("set_by_floor"):
        return text + (f": <b>these {at:,} discoveries are set by the null's resolution</b> (one fewer test beyond every "
                       f"null pair and none of them would pass q &le; {q_cut:g}); more null samples, not the scores, decide them.")
    return text + ", still a discovery: the count does not hang on one test."


def combo_key(metric: str, space: str) -> str:
    """A metric x space as the circuit chart's menu (its Vega parameter ``combo``) names it."""
    return f"{metric} · {space}"


def top_discoveries(edges: pl.DataFrame, info: dict, model: str, combos: list[tuple[str, str]],
                    lead: tuple[str, str] | None, candidates: bool, floor: pl.DataFrame, q_cut: float | None) -> str:
    """The strongest findings per comp and the floor note, for every metric x space of ``combos``:
    each in a ``<div data-combo="metric · space">``, all hidden but ``lead``'s, so that the page's
    script shows the one the circuit's menu picks (page.JS_EMBED). At most TOP_N rows per comp."""
    if edges.is_empty() or lead is None:
        return ""
    group = kv_group(info)
    blocks = []
    for metric, space in combos or [lead]:
        key = combo_key(metric, space)
        cell = floor.filter((pl.col("metric") == metric) & (pl.col("space") == space)) if floor.height else floor
        mine = edges.filter((pl.col("metric") == metric) & (pl.col("space") == space))
        # a magnitude's rows are its largest scores (model.circuit_edges_of), said so
        largest = "kind" in mine.columns and mine.height > 0 and (mine["kind"] == LARGEST).all()
        what = ("Largest scores" if largest else "Pairs with the smallest p (no discoveries)" if candidates
                else "Top discoveries")
        body = _one_cell(mine, group, model, metric, space, what, candidates or largest, cell, q_cut, largest)
        blocks.append(f"<div data-combo='{html.escape(key, quote=True)}'{'' if (metric, space) == lead else ' hidden'}>"
                      f"{body}</div>")
    return "".join(blocks)


def _one_cell(edges: pl.DataFrame, group: int, model: str, metric: str, space: str, what: str, candidates: bool,
              floor: pl.DataFrame, q_cut: float | None, largest: bool = False) -> str:
    head_line = f"<h3>{what}: {html.escape(metric)}, {html.escape(space)} space</h3>"
    if largest:
        head_line += note(f"<b>{html.escape(metric)} is a magnitude: its largest scores, not discoveries</b> (in its own "
                          "units; its non-causal null is heavy-tailed, so few or none of its pairs pass the false "
                          "discovery rate, though its largest K scores can be the circuit). Their p and q stand beside them.")
    if edges.is_empty():
        return head_line + note("No calibrated pairs in this metric x space." if candidates or q_cut is None else
                                f"No discoveries in {html.escape(metric)}, {html.escape(space)} space: no head pair "
                                f"composes beyond this model's own non-causal pairs there at q <= {q_cut:g}.")
    e = findings(edges, group, by_score=largest)
    parts, shared = [], None
    for comp in [c for c in COMPS if c in set(e["comp"])]:
        top = e.filter(pl.col("comp") == comp).head(TOP_N)
        shared = shared or next((readers_cell(r["reader_layer"], r["readers"]) for r in top.iter_rows(named=True)
                                 if len(r["readers"]) > 1), None)
        rows = [[head(r["writer_layer"], r["writer_head"]), readers_cell(r["reader_layer"], r["readers"]), r["score"],
                 r["baseline_spectrum_mean"], r["z_spectrum"], r["p_value"], fmt_q(r["q_value"], q_cut)]
                for r in top.iter_rows(named=True)]
        parts.append(f"<div><b>{comp}-composition</b>"
                     + table(["writer", "reader", "score", "spectrum null", "z", "p", "q"], rows) + "</div>")
    gqa = (f" Readers listed together (<code>{html.escape(shared)}</code>) are query heads of one key/value head "
           f"({group} query heads each): one finding, the same score, p and q." if shared else "")
    return (head_line
            + note(("One row per finding, largest score first" if largest else
                    "One row per finding, smallest q first (ties: smaller p, then larger z)")
                   + f"; at most {TOP_N} per comp.{gqa} "
                   f"All discoveries: <code>SELECT * FROM discoveries WHERE model = '{html.escape(model)}' AND latest "
                   f"AND metric = '{html.escape(metric)}' AND space = '{html.escape(space)}'</code>.")
            + "<div class='side'>" + "".join(parts) + "</div>" + ("" if candidates else floor_note(floor, q_cut)))
