"""Composition over training (docs/math.md#composition-over-training): when do induction heads
form, and which composition score tracks the formation rather than rising early for no
behavioural reason (the K-composition puzzle of "Composition Measures in Transformers")?

Definitions (the report states them):
- The *eventual* induction head is the head after the first layer with the highest
  induction score at the last checkpoint (ties: the larger ablation drop); the eventual
  previous-token head the highest previous-token score among the heads of earlier layers.
- The *formation step* is where the eventual induction head's induction score first
  crosses the midpoint between its value at the first checkpoint and its final value
  (linear interpolation between checkpoints). No formation if it rises by less than
  ``MIN_RISE``; the report then judges the curves against the *loss-drop step* (the
  steepest fall of the smoothed training loss) and says so.
- A curve (the eventual pair's score for one metric, space, comp) *tracks* the formation
  when it ends above where it was before the formation and its largest rise between
  consecutive checkpoints falls in the interval containing the formation step or next to it.
- A curve *rises early* when, before half the formation step (step 0, the initialisation,
  excluded), it already reaches its final value: high for no behavioural reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import polars as pl

MIN_RISE = 0.1


def eventual_heads(last: pl.DataFrame) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """(induction head, previous-token head) as (layer, head), from the last checkpoint's
    head scores (columns layer, head, induction_mean, prev_token_mean[, ablation_drop]): the
    induction head is looked for after the first layer; None for a one-layer model."""
    readers = last.filter(pl.col("layer") > last["layer"].min())
    if readers.is_empty():
        return None
    by = ["induction_mean"] + (["ablation_drop"] if "ablation_drop" in last.columns else [])  # ties: the one that matters
    ind = readers.sort(by, descending=True, nulls_last=True).row(0, named=True)
    earlier = last.filter(pl.col("layer") < ind["layer"])
    prev = earlier.sort("prev_token_mean", descending=True).row(0, named=True)
    return (ind["layer"], ind["head"]), (prev["layer"], prev["head"])


def formation_step(steps: np.ndarray, values: np.ndarray) -> float | None:
    """Step where ``values`` first crosses the midpoint of its first and last values."""
    steps, values = np.asarray(steps, float), np.asarray(values, float)
    if len(values) < 2 or values[-1] - values[0] < MIN_RISE:
        return None
    mid = (values[0] + values[-1]) / 2
    for i in range(1, len(values)):
        if values[i] >= mid > values[i - 1] or (values[i] >= mid and i == 1):
            v0, v1 = values[i - 1], values[i]
            return float(steps[i - 1] + (mid - v0) / (v1 - v0) * (steps[i] - steps[i - 1])) if v1 != v0 else float(steps[i])
    return None


def loss_drop_step(steps: np.ndarray, loss: np.ndarray, window: float = 0.05) -> float | None:
    """The step at the middle of the steepest fall of the training loss: the loss smoothed over
    ``window`` of the run, the largest drop across one window. None without a fall of at least
    ``MIN_RISE`` nats."""
    steps, loss = np.asarray(steps, float), np.asarray(loss, float)
    w = max(1, int(len(loss) * window))
    if len(loss) < 3 * w:
        return None
    c = np.concatenate([[0.0], np.cumsum(loss)])
    smooth = (c[w:] - c[:-w]) / w  # smooth[i]: mean of loss[i : i + w] (O(n), not O(n w))
    drops = smooth[:-w] - smooth[w:]
    i = int(np.argmax(drops))
    return float(steps[i + w]) if drops[i] >= MIN_RISE else None


def curve_verdict(steps: np.ndarray, values: np.ndarray, formation: float) -> dict[str, object]:
    """Does one composition curve track the formation, or rise early? (module docstring)"""
    steps, values = np.asarray(steps, float), np.asarray(values, float)
    before = values[steps < formation]
    final = float(values[-1])
    rises = np.diff(values)
    k = int(np.argmax(rises)) if len(rises) else 0  # largest rise: from checkpoint k to k + 1
    hit = int(np.searchsorted(steps, formation))    # the interval (hit - 1, hit] holds the formation
    tracks = bool(len(before) and final > before[-1] and abs((k + 1) - hit) <= 1 and rises[k] > 0)
    early = values[(steps > 0) & (steps <= formation / 2)]
    early_max = float(early.max()) if len(early) else float("nan")
    return {"final": final, "before_formation": float(before[-1]) if len(before) else float("nan"),
            "largest_rise_at": float(steps[k + 1]) if len(rises) else float("nan"),
            "early_max": early_max, "tracks": tracks, "rises_early": bool(len(early) and early_max >= final)}


def verdicts(curves: pl.DataFrame, formation: float) -> pl.DataFrame:
    """One verdict per (metric, space, comp) of ``curves`` (columns metric, space, comp, step, score)."""
    rows = []
    for (metric, space, comp), g in curves.sort("step").group_by(["metric", "space", "comp"], maintain_order=True):
        rows.append({"metric": metric, "space": space, "comp": comp,
                     **curve_verdict(g["step"].to_numpy(), g["score"].to_numpy(), formation)})
    return pl.DataFrame(rows)


def tracking(v: pl.DataFrame) -> pl.DataFrame:
    """The verdicts whose curve tracks the formation without rising early."""
    return v.filter(pl.col("tracks") & ~pl.col("rises_early"))


def statement(v: pl.DataFrame) -> str:
    """The sentence the report prints: which curves track the formation, which rise early."""
    def names(df: pl.DataFrame) -> str:
        return ", ".join(f"{r['comp']}-composition under {r['metric']} ({r['space']})" for r in df.iter_rows(named=True)) or "none"

    clean = tracking(v)
    early = v.filter(pl.col("rises_early"))
    return (f"Tracks the formation: {names(clean)}. Rises early (before half the marked step) to its final "
            f"value or above: {names(early)}.")


@dataclass
class TrainingOutcome:
    """What the composition-over-training analysis finds for one model with a checkpoint series."""
    heads: pl.DataFrame                 # head_scores at every checkpoint, with its step
    pair: tuple[tuple[int, int], tuple[int, int]] | None  # (induction head, previous-token head)
    formation: float | None             # formation step (formation_step)
    drop: float | None                  # loss-drop step (loss_drop_step)
    loss: pl.DataFrame                  # training loss per step (step, loss); empty without a training run
    curves: pl.DataFrame                # the pair's composition over training (metric, space, comp, step, score)

    @property
    def marker(self) -> float | None:
        """The step the curves are judged against: the formation, else the loss drop."""
        return self.formation if self.formation is not None else self.drop

    @cached_property
    def verdicts(self) -> pl.DataFrame | None:
        """verdicts of the curves against the marker (computed once: the overview and the
        model's page both show them)."""
        return None if self.marker is None or self.curves.is_empty() else verdicts(self.curves, self.marker)


def eventual_pair(heads: pl.DataFrame) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """``eventual_heads`` of the last checkpoint of ``heads`` (head scores with a ``step`` column)."""
    return None if heads.is_empty() else eventual_heads(heads.filter(pl.col("step") == heads["step"].max()))


def training_outcome(heads: pl.DataFrame, loss: pl.DataFrame, curves: pl.DataFrame) -> TrainingOutcome | None:
    """The composition-over-training analysis of one run from data frames: ``heads`` (head scores at every
    checkpoint, with ``step``), ``loss`` (step, loss; may be empty) and ``curves`` (the
    ``eventual_pair``'s composition: metric, space, comp, step, score). None with fewer than
    two checkpoints."""
    if heads.is_empty() or heads["step"].n_unique() < 2:
        return None
    drop = loss_drop_step(loss["step"].to_numpy(), loss["loss"].to_numpy()) if loss.height else None
    pair = eventual_pair(heads)
    if pair is None:
        return TrainingOutcome(heads, None, None, drop, loss, pl.DataFrame())
    (il, ih), _ = pair
    ind = heads.filter((pl.col("layer") == il) & (pl.col("head") == ih)).sort("step")
    formation = formation_step(ind["step"].to_numpy(), ind["induction_mean"].to_numpy())
    return TrainingOutcome(heads, pair, formation, drop, loss, curves)
