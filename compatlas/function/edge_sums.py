"""Per-edge sums over sequences that merge exactly: what an attribution job over a share of the
sequences hands the edge attribution job.

An edge's figures over S sequences (its mean, standard error and split halves, the means over
the even and over the odd sequences) need only, per edge, the count, the sum, the sum of squared
deviations from the mean (``m2``) and the sums over the even and the odd sequences (by the
sequence's index in the whole task, so that a share starting at an even index keeps its parity).
Two shares merge by Chan, Golub and LeVeque's update of ``m2``:

    m2 = m2_a + m2_b + (mean_b - mean_a)^2 n_a n_b / (n_a + n_b)

so the figures of S sequences split over several jobs are those of one job to float64 rounding
(the order of the sums differs), and one job never holds another's per-sequence scores.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import polars as pl
import torch

from compatlas.tables import EDGE_SUMS_SCHEMA
from compatlas.vocab import COMPS, Comp


@dataclass
class EdgeSums:
    """One method's sums over ``n`` sequences, per comp a float64 tensor of the scores' shape
    (writer layer, writer head, reader layer, reader head or KV head)."""

    n: int
    n_even: int
    total: dict[Comp, torch.Tensor]
    m2: dict[Comp, torch.Tensor]
    even: dict[Comp, torch.Tensor]
    odd: dict[Comp, torch.Tensor]

    @classmethod
    def of(cls, scores: dict[Comp, torch.Tensor], start: int = 0) -> EdgeSums:
        """The sums of per-sequence scores (comp -> [S, ...]) whose first sequence is the task's
        ``start``-th."""
        x0 = next(iter(scores.values()))
        n, first = x0.shape[0], start % 2  # the first of this share's even-indexed sequences
        total = {c: x.double().sum(0) for c, x in scores.items()}
        return cls(n=n, n_even=len(range(first, n, 2)), total=total,
                   m2={c: (x.double() - total[c] / max(n, 1)).pow(2).sum(0) for c, x in scores.items()},
                   even={c: x[first::2].double().sum(0) for c, x in scores.items()},
                   odd={c: x[1 - first::2].double().sum(0) for c, x in scores.items()})

    def merge(self, other: EdgeSums) -> EdgeSums:
        """The sums over both shares' sequences (module docstring)."""
        n = self.n + other.n
        if not self.n or not other.n:
            return other if not self.n else self
        m2 = {c: self.m2[c] + other.m2[c] + (other.total[c] / other.n - self.total[c] / self.n).pow(2)
              * (self.n * other.n / n) for c in self.total}
        return EdgeSums(n=n, n_even=self.n_even + other.n_even, m2=m2,
                        **{k: {c: getattr(self, k)[c] + getattr(other, k)[c] for c in self.total}
                           for k in ("total", "even", "odd")})

    def mean(self, c: Comp) -> torch.Tensor:
        return self.total[c] / self.n

    def stderr(self, c: Comp) -> torch.Tensor:
        """The standard error of the mean (sample standard deviation / sqrt n); NaN for one sequence."""
        if self.n < 2:
            return torch.full_like(self.total[c], math.nan)
        return (self.m2[c] / (self.n - 1)).sqrt() / math.sqrt(self.n)

    def halves(self, c: Comp) -> tuple[torch.Tensor, torch.Tensor]:
        """The means over the even and over the odd sequences (``edge_measure.split_halves``); NaN
        for fewer than two sequences."""
        n_odd = self.n - self.n_even
        if not self.n_even or not n_odd:
            nan = torch.full_like(self.total[c], math.nan)
            return nan, nan.clone()
        return self.even[c] / self.n_even, self.odd[c] / n_odd

    def frame(self, method: str) -> pl.DataFrame:
        """As rows of ``EDGE_SUMS_SCHEMA`` (every entry of every comp's tensor, flattened), to be
        written as a shard; the counts go in its provenance (``counts``)."""
        return pl.concat([pl.DataFrame({
            "method": method, "comp": c, "index": torch.arange(self.total[c].numel()).numpy(),
            **{k: getattr(self, k)[c].reshape(-1).numpy() for k in ("total", "m2", "even", "odd")},
        }).cast(EDGE_SUMS_SCHEMA) for c in COMPS])  # type: ignore[arg-type]

    def counts(self) -> dict[str, int]:
        return {"n": self.n, "n_even": self.n_even}

    @classmethod
    def from_frame(cls, df: pl.DataFrame, counts: dict[str, int], shapes: dict[Comp, tuple[int, ...]]) -> EdgeSums:
        """``frame``'s rows of one method back, with its ``counts`` and each comp's tensor shape."""
        parts: dict[str, dict[Comp, torch.Tensor]] = {k: {} for k in ("total", "m2", "even", "odd")}
        for c in COMPS:
            rows = df.filter(pl.col("comp") == c).sort("index")
            if rows.height != math.prod(shapes[c]):
                raise ValueError(f"edge sums of comp {c}: {rows.height} entries, the model's edges need "
                                 f"{math.prod(shapes[c])}")
            for k in parts:
                parts[k][c] = torch.from_numpy(rows[k].to_numpy().copy()).reshape(shapes[c])
        return cls(n=int(counts["n"]), n_even=int(counts["n_even"]), **parts)


def check_cover(ranges: Iterable[tuple[int, int]], total: int, jobs: str, unit: str = "sequences") -> None:
    """Refuse jobs' shares ([from, to) ranges) that do not cover 0..``total`` once, consecutively:
    the merge would silently average over missing or repeated sequences. ``jobs`` names the jobs
    in the message (``attribution``, ``exact``), ``unit`` what they share."""
    got = sorted(ranges)
    if not got or [a for a, _ in got] != [0] + [b for _, b in got[:-1]] or got[-1][1] != total:
        raise ValueError(f"the {jobs} jobs' sequences {got} do not cover the {total} {unit} once")


def sequence_share(sequences: int, jobs: int, job: int) -> slice:
    """The sequences of attribution job ``job`` of ``jobs``: consecutive shares as equal as even
    boundaries allow (each share starts at an even index, so the split halves keep their
    parity). Every share holds at least one sequence when ``2 jobs <= sequences``."""
    if not 0 <= job < jobs or 2 * jobs > sequences:
        raise ValueError(f"attribution job {job} of {jobs} over {sequences} sequences: each job needs 2 or more")

    def bound(i: int) -> int:
        return 2 * int(sequences * i / jobs / 2 + 0.5) if i < jobs else sequences  # halves round up

    return slice(bound(job), bound(job + 1))
