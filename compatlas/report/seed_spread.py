"""A trained model's figures over its training seeds: what the docs quote of the default run's
trained model (``induction-2l``), measured for each seed of the same recipe, with the mean and
range, so that a figure is quoted with the spread a rerun elsewhere can land in.

Training over 800 steps is chaotic near the phase change: a different seed, or the same seed on
float kernels that round differently, gives another model. Heads are named by role, not by
index (which head of a layer becomes the previous-token head is a coin toss of the seed): the
*eventual* induction and previous-token heads (``compatlas.behaviour.formation.eventual_heads``)
and the *circuit* edges, a previous-token head (score at least the atlas's 0.4) into an induction
head (likewise).

    .venv/bin/snakemake --cores 2 --configfile config/training-seeds.yaml
    .venv/bin/python -m compatlas.report.seed_spread results-seeds/atlas.duckdb
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass

import polars as pl

from compatlas.behaviour import formation as fm
from compatlas.report import queries as q

HEAD_CUT = 0.4  # a previous-token or induction head: its score at least this (the atlas's thresholds)
STEPS = (300, 400, 800)  # before, just after and long after the formation (near step 350)


@dataclass(frozen=True)
class Figure:
    key: str
    label: str
    digits: int  # as the docs print it (a step or a yes/no: 0)

    @property
    def yes_no(self) -> bool:
        return self.key.endswith(("_agrees", "_is_circuit"))


FIGURES = (
    *(Figure(f"loss_{s}", f"training loss at step {s}", 2) for s in STEPS),
    Figure("loss_drop_step", "fastest loss drop (step)", 0),
    Figure("formation_step", "formation step (induction head's score crosses its midpoint)", 0),
    *(Figure(f"induction_{s}", f"eventual induction head's induction score, step {s}", 2) for s in STEPS),
    Figure("induction_other_800", "the other layer-1 head's induction score, step 800", 2),
    *(Figure(f"prev_token_{s}", f"eventual previous-token head's score, step {s}", 2) for s in STEPS),
    *(Figure(f"strength_{s}", f"induction strength (B power), step {s}", 1) for s in STEPS),
    Figure("strength_peak", "induction strength, peak over the checkpoints", 1),
    Figure("top_exact_k", "top K edge by exact patching, step 800 (mean log-prob change)", 2),
    Figure("top_exact_k_stderr", "its standard error", 2),
    Figure("next_exact_k", "second K edge by exact patching, step 800", 2),
    Figure("top_exact_k_is_circuit", "top exact K edge is a previous-token head into an induction head (1 = yes)", 0),
    *(Figure(f"top_{m}_agrees", f"`{m}`'s top K edge is exact patching's (1 = yes)", 0) for m in ("eap", "eap_attn", "eap_ig")),
    *(Figure(f"spearman_{m}_K", f"`{m}` against exact patching, K, Spearman over 4 edges", 1) for m in ("eap", "eap_attn", "eap_ig")),
)
BY_KEY = {f.key: f for f in FIGURES}


def run_figures(con: q.Con, model: str) -> dict[str, float | None]:
    """``FIGURES`` for one trained model of the atlas (None where the atlas cannot say)."""
    steps = q.checkpoints(con).filter(pl.col("model") == model)
    heads = q.head_scores_over_training(con, model, steps)
    loss = q.loss(con, model)
    out: dict[str, float | None] = dict.fromkeys(BY_KEY)
    last = steps.filter(pl.col("latest"))["checkpoint"].item()
    for s in STEPS:
        hit = loss.filter(pl.col("step") == s)
        out[f"loss_{s}"] = float(hit["loss"].item()) if hit.height else None
    outcome = fm.training_outcome(heads, loss, pl.DataFrame())
    if outcome is not None:
        out["loss_drop_step"], out["formation_step"] = outcome.drop, outcome.formation
    if outcome is not None and outcome.pair is not None:
        (il, ih), (pl_, ph) = outcome.pair
        for s in STEPS:
            row = heads.filter(pl.col("step") == s)
            ind, prev = (row.filter((pl.col("layer") == a) & (pl.col("head") == b)) for a, b in ((il, ih), (pl_, ph)))
            out[f"induction_{s}"] = float(ind["induction_mean"].item()) if ind.height else None
            out[f"prev_token_{s}"] = float(prev["prev_token_mean"].item()) if prev.height else None
        final = heads.filter((pl.col("step") == heads["step"].max()) & (pl.col("layer") == il) & (pl.col("head") != ih))
        out["induction_other_800"] = float(final["induction_mean"].max()) if final.height else None  # type: ignore[arg-type]
    strength = con.execute("""SELECT c.checkpoint_step, avg(s.mean_strength) FROM induction_summary s
                              JOIN checkpoints c USING (model, checkpoint)
                              WHERE s.model = ? AND s.role = 'B' GROUP BY ALL ORDER BY 1""", [model]).fetchall()
    by_step = {int(st): float(v) for st, v in strength if st is not None}
    for s in STEPS:
        out[f"strength_{s}"] = by_step.get(s)
    out["strength_peak"] = max(by_step.values()) if by_step else None
    edges = con.execute("""SELECT writer_layer, writer_head, reader_layer, reader_head, exact, exact_stderr
                           FROM edge_attribution WHERE model = ? AND checkpoint = ? AND comp = 'K' AND method = 'eap'
                             AND exact IS NOT NULL
                           ORDER BY abs(exact) DESC, writer_layer, writer_head, reader_layer, reader_head""", [model, last]).fetchall()
    if len(edges) >= 2:
        top = edges[0]
        out["top_exact_k"], out["top_exact_k_stderr"], out["next_exact_k"] = top[4], top[5], edges[1][4]
        last_heads = heads.filter(pl.col("step") == heads["step"].max()) if heads.height else heads
        prev_heads = {(r["layer"], r["head"]) for r in last_heads.iter_rows(named=True) if (r["prev_token_mean"] or 0) >= HEAD_CUT}
        ind_heads = {(r["layer"], r["head"]) for r in last_heads.iter_rows(named=True) if (r["induction_mean"] or 0) >= HEAD_CUT}
        out["top_exact_k_is_circuit"] = float((top[0], top[1]) in prev_heads and (top[2], top[3]) in ind_heads)
    for method, spearman, agrees in con.execute("""SELECT method, spearman, top_edge_agrees FROM eap_vs_exact
                                                   WHERE model = ? AND checkpoint = ? AND comp = 'K'""", [model, last]).fetchall():
        out[f"spearman_{method}_K"] = spearman
        out[f"top_{method}_agrees"] = float(agrees) if agrees is not None else None
    return out


def _fmt(v: float | None, digits: int) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:.{digits}f}"


def spread(values: Sequence[float | None]) -> tuple[float, float, float, int] | None:
    """(mean, min, max, n) of the values a figure has (None where no seed has it)."""
    have = [v for v in values if v is not None and math.isfinite(v)]
    return (sum(have) / len(have), min(have), max(have), len(have)) if have else None


def spread_table(figures: dict[str, dict[str, float | None]]) -> str:
    """The markdown table the docs quote: one row per figure, one column per run (seed), then the
    mean, the range and how many seeds have the figure (a formation step only where one forms)."""
    runs = list(figures)
    head = "| figure | " + " | ".join(runs) + " | mean | range | seeds |"
    lines = [head, "|" + "---|" * (len(runs) + 4)]
    for f in FIGURES:
        vals = [figures[r].get(f.key) for r in runs]
        s = spread(vals)
        cells = [_fmt(v, f.digits) for v in vals]
        if s is None:
            tail = ["-", "-", "0"]
        elif f.yes_no:  # how many say yes
            tail = [f"{sum(v == 1 for v in vals)} of {s[3]}", "-", str(s[3])]
        else:
            tail = [_fmt(s[0], f.digits), f"{_fmt(s[1], f.digits)} to {_fmt(s[2], f.digits)}", str(s[3])]
        lines.append(f"| {f.label} | " + " | ".join(cells + tail) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from compatlas.atlas import connect

    p = argparse.ArgumentParser(prog="python -m compatlas.report.seed_spread", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("atlas", help="an atlas of one recipe's seeds (results-seeds/atlas.duckdb)")
    p.add_argument("--models", nargs="*", help="the runs, in column order (default: every trained model)")
    args = p.parse_args(argv)
    con = connect(args.atlas)
    models = args.models or [r[0] for r in con.execute(
        "SELECT DISTINCT model FROM models WHERE source_kind = 'trained' ORDER BY model").fetchall()]
    print(spread_table({m: run_figures(con, m) for m in models}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
