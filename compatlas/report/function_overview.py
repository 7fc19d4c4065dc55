"""The overview's composition against function (docs/edge_attribution.md#noise-aware-agreement):
which metric x space's K-composition agrees best with function across the models whose K
function is measurable, each model's paired bootstrap (``function.CompFunction``) averaged."""

from __future__ import annotations

import html
import warnings
from typing import Any

import duckdb
import numpy as np
import polars as pl

from compatlas.function import agreement as ag
from compatlas.function.comp_agreement import PRIOR, REFERENCES, cell_order
from compatlas.function.comp_agreement import verdict as comp_verdict
from compatlas.report import queries as q
from compatlas.report.function import ORACLES, RULES, SCALE, CompFunction, cell_name, cell_names, tier_mark, with_interval
from compatlas.report.page import fmt, note, table
from compatlas.vocab import WEIGHT_SPACES


def overview_table(con: duckdb.DuckDBPyConnection, data: list[Any], fns: dict[str, dict[str, CompFunction]]) -> str:
    """Which metric x space's K-composition agrees best with function across the models whose K
    function is measurable, on the noise-aware statistic: the mean over them of the Spearman with
    the unbiased function estimate, with a bootstrap interval (each model's replicates averaged),
    best or tied, and whether it beats the scale oracle beyond the paired interval, the two
    oracles' own rows beside; then, labelled, the mean AUROC against |attribution|; the models
    left out, and why."""
    if not q.has(con, "composition_vs_function", "method", "auroc"):
        return ""
    head_ = "<h2 id='function'>Which metric x space agrees with function</h2>"
    k = {d.model: fns[d.model]["K"] for d in data if "K" in fns.get(d.model, {})}
    if not k:
        return head_ + note("No model in this atlas has edge attribution.")
    inn = {m: f for m, f in k.items() if f.agreement is not None and f.noise is not None}
    out = "".join(f"<li>{html.escape(m)}: {html.escape(f.gate.why or 'no split halves (an atlas built before them)')}</li>"
                  for m, f in k.items() if m not in inn)
    left = (f"<p>Left out, no K function to predict:</p><ul class='note'>{out}</ul>" if out else "")
    intro = note("K-composition against edge attribution (each model page's method, last checkpoint), averaged over the "
                 "models with a K function to predict. Ranked by the Spearman with the unbiased function estimate (the "
                 "product of two independent halves' attributions), beside two oracles that know nothing of which edge "
                 "does what (the edge's own sampling error, the mean |attribution| of its layer pair), and a prior that needs "
                 "neither function nor composition (nearer layers first). A cell agrees with function where the interval "
                 "of its mean Spearman is above 0; it is beyond the prior, or beats both oracles, where it beats them "
                 "beyond the paired interval; it adds to scale and depth where its mean partial Spearman beyond both "
                 "oracles (their ranks regressed out) has an interval above 0. " + RULES)
    if not inn:
        return head_ + intro + "<p><b>No model in this atlas has a K function to predict</b>: no ranking across models.</p>" + left
    models = list(inn)
    cells = cell_order(list(set.intersection(*(set(f.cells) for f in inn.values())) - set(REFERENCES))) + list(REFERENCES)

    def stack(a_of: str, which: str, boot: bool) -> np.ndarray:
        rows = []
        for f in inn.values():
            a = getattr(f, a_of)
            src = getattr(a, f"{which}_boot" if boot else which)
            rows.append(src[[f.cells.index(c) for c in cells]])
        with warnings.catch_warnings():  # a cell NaN in every model (a constant oracle) stays NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            return np.nanmean(np.stack(rows), axis=0)

    point, boot = stack("noise", "spearman", False), stack("noise", "spearman", True)
    apoint, aboot = stack("agreement", "auroc", False), stack("agreement", "auroc", True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        lo, hi = np.nanquantile(boot, [0.025, 0.975], axis=1)
        alo, ahi = np.nanquantile(aboot, [0.025, 0.975], axis=1)
    scale, prior = cells.index(SCALE), cells.index(PRIOR)
    has_partial = all(f.partial is not None for f in inn.values())
    if has_partial:
        pboot = stack("partial", "partial", True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            plo, _ = np.nanquantile(pboot, [0.025, 0.975], axis=1)

    def beats(i: int, ref: int | None = None) -> bool:  # a constant reference (NaN) ranks nothing: it counts as 0
        d = boot[i] - np.nan_to_num(boot[scale if ref is None else ref], nan=0.0)
        d = d[np.isfinite(d)]
        return bool(len(d)) and float(np.quantile(d, (1 - ag.LEVEL) / 2)) > 0

    def tiers(i: int) -> dict[str, bool | None]:
        return {"agrees": bool(lo[i] > 0) if np.isfinite(lo[i]) else None, "beyond_prior": beats(i, prior),
                "beats_oracles": beats(i) and beats(i, scale + 1),
                "adds_to_oracles": bool(plo[i] > 0) if has_partial and np.isfinite(plo[i]) else None}

    def verdict(idx: list[int], label: str) -> tuple[str, set[int], int | None]:
        if not idx:
            return "", set(), None
        b, tied = ag.best_and_ties(point[idx], boot[idx])
        best, tied_cells = idx[b], [idx[t] for t in tied]
        what = f"<b>{cell_name(cells[best])}</b> (mean Spearman {with_interval(point[best], (lo[best], hi[best]))})"
        claim = "it " + (comp_verdict(tiers(best)) or "cannot be placed")
        orc = (f"scale oracle {with_interval(point[scale], (lo[scale], hi[scale]))}, depth oracle "
               f"{with_interval(point[scale + 1], (lo[scale + 1], hi[scale + 1]))}, prior "
               f"{with_interval(point[prior], (lo[prior], hi[prior]))}")
        if tied_cells:
            return (f"<p>{label}: no single best; {what} is tied with {cell_names([cells[t] for t in tied_cells])}; {orc}; "
                    f"{claim}.</p>"), set(tied_cells), best
        return f"<p>{label}: {what}, beyond the uncertainty of every other cell; {orc}; {claim}.</p>", set(), best

    n = len(models)
    over = f"over {n} model{'s' if n != 1 else ''} ({', '.join(html.escape(m) for m in models)})"
    comp_idx = [i for i, c in enumerate(cells) if c not in REFERENCES]
    all_line, all_tied, all_best = verdict(comp_idx, f"Agrees best across models, {over}")
    w_line, _, _ = verdict([i for i in comp_idx if cells[i][1] in WEIGHT_SPACES],
                           "From the weights alone (" + ", ".join(WEIGHT_SPACES) + " spaces)")
    within = within_layer_pair(con, data, inn, cells)
    rows = []
    for i in [*sorted(comp_idx, key=lambda i: -np.nan_to_num(point[i], nan=-2)), scale, scale + 1, prior]:
        oracle = cells[i] in REFERENCES
        mark = ("oracle" if cells[i] in ORACLES else "prior" if i == prior else "best" if i == all_best and not all_tied else
                "tied" if i == all_best or i in all_tied else "")
        per = [with_interval(n_.spearman[inn[m].cells.index(cells[i])], inn[m].interval(cells[i], "spearman", True))
               for m in models if (n_ := inn[m].noise) is not None]
        rows.append([cells[i][0], cells[i][1], with_interval(point[i], (lo[i], hi[i])), mark,
                     "" if oracle else tier_mark(tiers(i)), fmt(within[i]),
                     with_interval(apoint[i], (alo[i], ahi[i])), *per])
    one = note("One model: each mean is that model's own figure, so the per-model column repeats it.") if n == 1 else ""
    sizes = "; ".join(f"{html.escape(m)} ({f.method}): {f.gate.n_edges:,} K edges, {f.n_significant:,} with attribution "
                      f"beyond zero (q ≤ FDR), top of the function {f.gate.n_top:,} edges" for m, f in inn.items())
    legend = note("Rank: <i>best</i>, the highest mean beyond every other cell's paired interval; <i>tied</i>, the best "
                  "and the cells it does not beat beyond the paired interval; blank, beaten by the best. Within a layer "
                  "pair: the same Spearman computed inside each writer x reader layer pair and averaged "
                  "(composition_vs_function's spearman_unbiased_within_layer_pair; a point figure): what a score tells "
                  "apart once depth, and the scale that comes with it, is taken out. Samples: " + sizes + ".")
    return (head_ + intro + all_line + w_line + one + left
            + table(["metric", "space", "mean Spearman, unbiased [95%]", "rank", "tiers: agrees · beyond prior · beats oracles · adds",
                     "mean Spearman within layer pair", "mean AUROC, top of |attribution| [95%]",
                     *[f"Spearman {m}" for m in models]], rows) + legend)


def within_layer_pair(con: duckdb.DuckDBPyConnection, data: list[Any], inn: dict[str, CompFunction],
                      cells: list[tuple[str, str]]) -> list[float | None]:
    """Per cell, the mean over the ranked models of composition_vs_function's K Spearman with the
    unbiased function estimate within layer pairs (each model's method, last checkpoint); None where
    no model has it."""
    latest = {d.model: d.latest for d in data}
    vals: dict[tuple[str, str], list[float]] = {c: [] for c in cells}
    for m, f in inn.items():
        df = q.composition_vs_function(con, m, latest[m], {"K": f.method})
        if "spearman_unbiased_within_layer_pair" not in df.columns:
            continue
        for metric, space, v in df.filter(pl.col("comp") == "K").select(
                "metric", "space", "spearman_unbiased_within_layer_pair").iter_rows():
            if (metric, space) in vals and v is not None and np.isfinite(v):
                vals[(metric, space)].append(float(v))
    return [float(np.mean(vals[c])) if vals[c] else None for c in cells]
