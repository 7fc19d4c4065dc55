"""Which head pairs compose beyond chance: p-values against the model's own non-causal pairs.

A reader head in a layer below its writer's can never read that writer's output, yet the pair
shares every geometric property of the model: the same subspaces, norms, anisotropy, basis and
quantisation. Scored by the same kernel, these anti-causal pairs are an empirical null for the
causal ones (writer layer < reader layer). The default null is the causal set's mirror image:
each causal pair (writer in layer a, reader in layer b > a) has exactly one twin per head pair,
writer in b and reader in a, so the null holds the same layers at the same distances, in the
same proportions, as the pairs it calibrates:

    p = (1 + #{null >= score}) / (1 + N)

within one model x checkpoint x metric x space x comp (and, with ``stratify="distance"``,
within one layer distance |reader - writer|).
Beyond the null's maximum the empirical p is floored at 1 / (1 + N), whatever the score; there
the tail of the null is modelled instead, and p is the smaller of the floor and the tail's p
(a generalised Pareto fit to the largest null scores, as in Knijnenburg et al. 2009, "Fewer
permutations, more accurate P-values"). Its shape is taken at the upper end of its one-sided 95%
confidence interval (MLE + 1.645 (1 + xi) / sqrt(k), k tail scores), so the extrapolated p is an
upper bound: fitted to 20,000 draws of known Pareto and exponential nulls, it is conservative at
1e-5 and 2e-6 in 95% of draws and a median 0.6 to 1.1 decades too large there, where the plain
MLE is too small by up to 1.4 decades in 5% of draws. A bounded tail (shape < 0) becomes an
exponential one, which again overstates p. A null too
small to fit (< ``TAIL_MIN_NULL``) keeps the empirical p with its floor.

q-values are Benjamini-Hochberg adjusted p-values over the causal pairs of the same group:
the pairs with q <= FDR are the discoveries, of which the expected share of false ones is at
most FDR (BH holds for independent or positively dependent p-values).

One hypothesis per distinct test. In a grouped-query model the g query heads of a KV group
share W_K and W_V, and some scores cannot differ across them (``hypothesis_unit``): then the
family and the null hold that test once, as writer head x reader KV head, not g times (g copies
of one test would let BH count one finding g times, and a null pair g times). Each query head's
row carries its test's p and q, its ``test_unit`` and its ``reader_kv_head``; the rows of a KV
head's test are checked to hold one score, so a kernel that started to tell them apart would
stop the calibration rather than be counted as one test.

Same-layer pairs of distinct heads cannot read each other either, and the composition jobs
score them, but they are out of the default null (``null_pairs="mirror"``): no causal pair has
layer distance 0, and heads of one layer are trained side by side on the same input, so they
share channels more than any causal pair's heads do (on SmolLM2 the null's maximum in token
space is such a pair). Pooling them in would compare every causal pair with a population it
does not contain; ``null_pairs="mirror_and_same_layer"`` does so anyway, a stricter test.
Self pairs (a head with itself) are never in the null: a head's own W_OV and W_QK are trained
together and are not exchangeable with other pairs. For a KV head's test that includes a writer
with the reader KV head of its own group (same layer), whose W_V the writer's own OV uses.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import polars as pl

from compatlas.multiple_testing import bh_q_values
from compatlas.tables import CALIBRATION_SCHEMA
from compatlas.vocab import COMPS, METRICS, NULL_PAIRS, NULL_STRATIFY, Comp, Metric, NullPairs, NullStratify, TestUnit

TAIL_MIN_EXCEEDANCES = 10  # the tail fit needs at least this many null scores above its threshold
TAIL_MIN_NULL = 100  # fewer null pairs than this: no tail fit, empirical p only
TAIL_SHARE, TAIL_MAX = 0.10, 250  # the tail fit uses the top 10% of the null, at most 250 scores
TAIL_SHAPE_Z = 1.645  # the shape's one-sided 95% upper bound: the tail p errs on the large side

KEY = ["model", "checkpoint", "processing", "metric", "space", "comp",
       "writer_layer", "writer_head", "reader_layer", "reader_head"]

# The metric x comp cells whose score depends on the reader only through its KV head
# (compatlas.composition.scores.head_factors, reader R = A B): ``subspace`` uses the column space of A
# alone, and A is W_K for K and W_V for V, one per KV head (for Q it is W_Q, per query head).
# frobenius and svd_bound use A B, with B = W_Q (K) or W_O (V) per query head. Token spaces
# transform every head's W_K and W_V alike, so the space does not change this.
# tests/test_calibration.py checks it, both ways, against the kernel's scores of GQA models.
KV_SHARED: frozenset[tuple[Metric, Comp]] = frozenset({("subspace", "K"), ("subspace", "V")})
KV_SHARED_RTOL = 1e-6  # rows of one KV head's test agree to this (relative); the kernel repeats one value


def hypothesis_unit(metric: str, comp: str, kv_group: int) -> TestUnit:
    """What one test is in ``metric`` x ``comp`` of a model whose KV heads serve ``kv_group``
    query heads each: a writer head x reader query head, or a writer head x reader KV head."""
    if metric not in METRICS or comp not in COMPS:
        raise ValueError(f"metric {metric!r}, comp {comp!r}: choose from {METRICS} and {COMPS}")
    return "kv_head" if kv_group > 1 and (metric, comp) in KV_SHARED else "query_head"


def tail_survival(null: np.ndarray) -> tuple[float, float, float, float] | None:
    """Fit the upper tail of ``null``: (threshold t, share of null above t, shape xi >= 0, scale),
    the shape at its 95% upper bound.

    P(null >= x) = share * (1 + xi (x - t) / scale) ** (-1 / xi) for x > t (exponential at xi = 0).
    None when the null is too small to say anything beyond its own maximum."""
    from scipy import stats  # imported here: the module imports without scipy until a p-value is fitted

    null = np.sort(null[np.isfinite(null)])
    n = len(null)
    if n < TAIL_MIN_NULL:
        return None
    k = max(min(int(n * TAIL_SHARE), TAIL_MAX), TAIL_MIN_EXCEEDANCES)
    t = 0.5 * (null[n - k - 1] + null[n - k])  # between the k-th and (k+1)-th largest
    excess = null[n - k:] - t
    if not np.any(excess > 0):
        return None
    xi, _, scale = stats.genpareto.fit(excess, floc=0)
    if np.isfinite(xi):  # asymptotic sd of the shape's MLE: (1 + xi) / sqrt(k)
        xi = xi + TAIL_SHAPE_Z * (1.0 + max(xi, 0.0)) / np.sqrt(k)
    if not np.isfinite(xi) or xi <= 0:  # a bounded (light) tail: extrapolate it as exponential instead
        xi, scale = 0.0, float(excess.mean())
    return float(t), k / n, float(xi), float(scale)


def _tail_p(x: np.ndarray, fit: tuple[float, float, float, float]) -> np.ndarray:
    t, share, xi, scale = fit
    z = np.maximum(x - t, 0.0) / scale
    return share * (np.exp(-z) if xi == 0.0 else (1.0 + xi * z) ** (-1.0 / xi))


def empirical_p_values(scores: np.ndarray, null: np.ndarray, tail: bool = True) -> np.ndarray:
    """p of each score against the null scores: (1 + #null >= score) / (1 + N), and beyond the
    null's maximum the smaller of that floor and the tail model's p (``tail=True``).
    NaN scores get NaN; an empty null gives p = 1."""
    scores = np.asarray(scores, dtype=np.float64)
    null = np.sort(np.asarray(null, dtype=np.float64)[np.isfinite(null)])
    n = len(null)
    exceed = n - np.searchsorted(null, scores, side="left")
    p = (1.0 + exceed) / (1.0 + n)
    fit = tail_survival(null) if tail else None
    beyond = exceed == 0
    if fit is not None and beyond.any():
        # only past the null's maximum, and never above the empirical floor: below the maximum the
        # counting p is exact under exchangeability, and p stays monotone in the score
        p[beyond] = np.minimum(p[beyond], _tail_p(scores[beyond], fit))
    p[~np.isfinite(scores)] = np.nan
    return p


def _stratum(df: pl.DataFrame, stratify: NullStratify) -> pl.Series:
    if stratify == "none":
        return pl.Series(np.zeros(df.height, dtype=np.int64))
    return (df["reader_layer"] - df["writer_layer"]).abs().cast(pl.Int64)


def _one_per_test(df: pl.DataFrame, unit: TestUnit, kv_group: int, cell: tuple) -> pl.DataFrame:
    """``df``'s rows of one metric x space x comp with ``_unit`` (the reader's query or KV head),
    one row per test: a KV head's test keeps its first row, after checking that its rows agree."""
    if unit == "query_head":
        return df.with_columns(pl.col("reader_head").alias("_unit"))
    df = df.with_columns((pl.col("reader_head") // kv_group).alias("_unit"))
    keys = ["writer_layer", "writer_head", "reader_layer", "_unit"]
    spread = df.group_by(keys).agg((pl.col("score").max() - pl.col("score").min()).alias("d"),
                                   pl.col("score").abs().max().alias("s"))
    bad = spread.filter(pl.col("d") > KV_SHARED_RTOL * pl.max_horizontal(pl.col("s"), pl.lit(1e-12)))
    if bad.height:
        r = bad.row(0, named=True)
        raise ValueError(f"{'/'.join(map(str, cell))}: the query heads of KV head {r['_unit']} (reader layer "
                         f"{r['reader_layer']}, writer L{r['writer_layer']}.H{r['writer_head']}) score differently "
                         f"(spread {r['d']:.3g}), so these are not one test per KV head: see calibration.KV_SHARED")
    return df.unique(keys, keep="first", maintain_order=True)


def calibrate(causal: pl.DataFrame, null: pl.DataFrame, stratify: NullStratify = "none", tail: bool = True,
              null_pairs: NullPairs = "mirror", *, kv_group: int) -> pl.DataFrame:
    """p- and q-values of every causal pair (columns ``tables.CALIBRATION_SCHEMA``).

    ``causal`` and ``null`` are composition tables (``COMPOSITION_SCHEMA``) of one model x checkpoint,
    any metrics, spaces and comps; each group of those is calibrated on its own null, which is
    ``null``'s anti-causal pairs (``"mirror"``) or all of its rows (``"mirror_and_same_layer"``).
    ``kv_group``: query heads per KV head (1 without grouped-query attention; query head h reads
    KV head h // kv_group). Where ``hypothesis_unit`` is ``kv_head`` the family and the null
    hold each writer head x reader KV head once; every query head's row gets its test's p and q."""
    if stratify not in NULL_STRATIFY:
        raise ValueError(f"stratify {stratify!r}: choose one of {NULL_STRATIFY}")
    if null_pairs not in NULL_PAIRS:
        raise ValueError(f"null_pairs {null_pairs!r}: choose one of {NULL_PAIRS}")
    if kv_group < 1:
        raise ValueError(f"kv_group {kv_group}: query heads per KV head is at least 1")
    if null_pairs == "mirror":
        null = null.filter(pl.col("writer_layer") != pl.col("reader_layer"))
    groups = ["model", "checkpoint", "processing", "metric", "space", "comp"]
    null_by = null.partition_by(groups, as_dict=True)
    test = ["writer_layer", "writer_head", "reader_layer", "_unit"]
    parts = []
    for key, g in causal.group_by(groups, maintain_order=True):
        unit = hypothesis_unit(key[3], key[5], kv_group)
        tests = _one_per_test(g, unit, kv_group, key)
        ref = null_by.get(key, null.clear())
        if unit == "kv_head":  # a writer with its own KV head is a self pair (module docstring)
            ref = ref.filter((pl.col("writer_layer") != pl.col("reader_layer"))
                             | (pl.col("writer_head") // kv_group != pl.col("reader_head") // kv_group))
        ref = _one_per_test(ref, unit, kv_group, key)
        strata, ref_strata = _stratum(tests, stratify).to_numpy(), _stratum(ref, stratify).to_numpy()
        scores, ref_scores = tests["score"].to_numpy(), ref["score"].to_numpy()
        p = np.empty(tests.height)
        n_null = np.empty(tests.height, dtype=np.int64)
        for s in np.unique(strata):
            rows = strata == s
            p[rows] = empirical_p_values(scores[rows], ref_scores[ref_strata == s], tail)
            n_null[rows] = int((ref_strata == s).sum())
        pq = tests.select(test).with_columns(pl.Series("n_null", n_null), pl.Series("p_value", p),
                                             pl.Series("q_value", bh_q_values(p)))
        rows_of = g.select(KEY).with_columns(
            (pl.col("reader_head") // kv_group if unit == "kv_head" else pl.col("reader_head")).alias("_unit"))
        parts.append(rows_of.join(pq, on=test, how="left", maintain_order="left").with_columns(
            pl.lit(unit).alias("test_unit"), (pl.col("reader_head") // kv_group).alias("reader_kv_head")))
    if not parts:
        return pl.DataFrame(schema=CALIBRATION_SCHEMA)
    return pl.concat(parts).select(list(CALIBRATION_SCHEMA)).cast(pl.Schema(CALIBRATION_SCHEMA))


def calibrate_shards(causal: Sequence[str], null: Sequence[str], stratify: NullStratify = "none",
                     tail: bool = True, null_pairs: NullPairs = "mirror", *, kv_group: int) -> Iterator[pl.DataFrame]:
    """``calibrate`` over composition shards, one metric x space at a time (the blocks of one
    metric x space share a folder), so memory holds one metric x space, never a whole model."""
    by_folder: dict[str, tuple[list[str], list[str]]] = defaultdict(lambda: ([], []))
    for i, paths in enumerate((causal, null)):
        for path in paths:
            folder = f"{Path(path).parent.parent.name}/{Path(path).parent.name}"  # metric=../space=..
            by_folder[folder][i].append(str(path))
    for folder, (c_paths, n_paths) in by_folder.items():
        if not c_paths:
            raise ValueError(f"null shards of {folder} have no causal shards beside them")
        scores = pl.read_parquet(c_paths)
        yield calibrate(scores, pl.read_parquet(n_paths) if n_paths else scores.clear(), stratify, tail, null_pairs,
                        kv_group=kv_group)
