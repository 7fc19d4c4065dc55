"""A synthetic atlas for the report's tests and benchmark: real shards and views
(``compatlas.atlas.build_atlas``) with a planted circuit, built fast with numpy.

Each model has a previous-token head (0, 1), induction heads in its last third (head 0 of
those layers), and the K-composition of the first into the second far above every other pair,
with p and q values that make exactly those pairs discoveries. With several checkpoints the
induction heads form at the middle step and the loss drops there. With ``circuit_in`` the
circuit is planted in that one metric x space only, and every other one gets K discoveries that
are not the circuit instead (from head (0, 0), no previous-token head, into every later head):
more K discoveries than the circuit's cell, none of them from a previous-token head into an
induction head.

``n_kv_heads`` makes a grouped-query model: ``subspace`` K and V (the cells the calibration tests
per key/value head, ``calibration.KV_SHARED``) get one score, p and q per writer x reader KV head,
shared by its query heads' rows. ``planted=False`` makes a random model: no circuit, no
previous-token or induction head, uniform p (a discovery is then a false one, as chance gives);
``stray`` plants one such false discovery in a (metric, space, comp). ``contribution`` is a
magnitude (scores in its own units, ``MAGNITUDE_UNITS`` times the others') whose heavy-tailed
null gives it no discoveries: its p never goes below 0.01, planted pairs included, though its
largest K scores are the circuit.

``default_run()``: the default run's models in shape (config/config.yaml): SmolLM2-like 30 x 9
heads with 3 KV heads and edge attribution, two random 4 x 8 models (one with 2 KV heads) and the
trained 2 x 2 model's checkpoint series, 4 metrics x 4 spaces (3 spaces for the trained one)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
import polars as pl

from compatlas.atlas import build_atlas
from compatlas.atlas.files import last_good_path
from compatlas.function.comp_agreement import agreement_tables
from compatlas.storage import checksum_path, write_shard
from compatlas.tables import (
    CALIBRATION_SCHEMA,
    COMPOSITION_SCHEMA,
    EDGE_ATTRIBUTION_SCHEMA,
    HEAD_SCORES_SCHEMA,
    INDUCTION_TOKENS_SCHEMA,
    INVARIANCE_SCHEMA,
    METRIC_AUDIT_SCHEMA,
    TRAINING_LOSS_SCHEMA,
)
from compatlas.vocab import COMPS, KERNEL_METRICS


@dataclass
class Spec:
    name: str
    n_layers: int
    n_heads: int
    steps: list[int] | None = None  # checkpoint steps; None: one checkpoint "final"
    quantized: bool = False
    edges: bool = False  # edge attribution shards (eap, eap_ig) with the planted K edges carrying the task
    function: bool = True  # with ``edges``: K edges carry the task; False: every attribution is noise (a random model)
    circuit_in: tuple[str, str] | None = None  # (metric, space) of the planted circuit; None: every one
    n_kv_heads: int | None = None  # grouped-query attention: n_heads // n_kv_heads query heads per KV head
    planted: bool = True  # False: a random model (no circuit, no previous-token or induction heads)
    stray: tuple[str, str, str] | None = None  # (metric, space, comp) with one false discovery (p = 1e-7)
    spaces: tuple[str, ...] | None = None  # this model's spaces; None: write_suite's
    methods: tuple[str, ...] = ("eap", "eap_ig")  # with ``edges``: the attribution methods (the default run: eap)
    n_null: int | None = None  # a null this small (the trained 2 x 2 model's 4 mirror pairs): p >= 1 / (n_null + 1)


MAGNITUDE_UNITS = 100.0  # contribution's scores, in its own units, against the normalised metrics' [0, 1]
KV_SHARED = {("subspace", "K"), ("subspace", "V")}  # tested per KV head (compatlas.composition.calibration)


TRACKING = ("subspace", "residual")  # the one metric x space whose K score follows the K function (below the planted edges)


def _k_function(wl: np.ndarray, wh: np.ndarray, rl: np.ndarray, rh: np.ndarray) -> np.ndarray:
    """A fixed share in [0, 1) per K edge: the part of the task each non-planted K edge carries,
    which the TRACKING cell's score follows."""
    return ((7 * wl + 3 * wh + 5 * rl + 11 * rh) % 13) / 13


def _checkpoints(s: Spec) -> list[tuple[str, int | None]]:
    return [("final", None)] if not s.steps else [(f"step{t}", t) for t in s.steps]


def _formed(step: int | None, s: Spec) -> float:
    """0 before the formation (middle step), 1 after; 1 without a series."""
    if step is None or not s.steps:
        return 1.0
    mid = s.steps[len(s.steps) // 2]
    return float(1 / (1 + np.exp(-(step - mid) / max(mid / 8, 1))))


def _pairs(L: int, H: int) -> tuple[np.ndarray, ...]:
    wl, rl = np.triu_indices(L, 1)
    wl, rl = np.repeat(wl, H * H), np.repeat(rl, H * H)
    n_lp = len(wl) // (H * H)
    wh = np.tile(np.repeat(np.arange(H), H), n_lp)
    rh = np.tile(np.tile(np.arange(H), H), n_lp)
    return wl.astype(np.int32), wh.astype(np.int32), rl.astype(np.int32), rh.astype(np.int32)


def _bh(p: np.ndarray) -> np.ndarray:
    order = np.argsort(p)
    q = p[order] * len(p) / np.arange(1, len(p) + 1)
    q = np.minimum.accumulate(q[::-1])[::-1]
    out = np.empty_like(q)
    out[order] = np.minimum(q, 1.0)
    return out


def _composition(s: Spec, ck: str, step: int | None, metrics, spaces, rng) -> tuple[pl.DataFrame, pl.DataFrame]:
    wl, wh, rl, rh = _pairs(s.n_layers, s.n_heads)
    n = len(wl)
    g = s.n_heads // (s.n_kv_heads or s.n_heads)
    kv = rh // g
    ind_layers = set(range(max(1, (2 * s.n_layers) // 3), s.n_layers))
    planted = (wl == 0) & (wh == 1) & np.isin(rl, list(ind_layers)) & (rh == 0) & s.planted
    planted_kv = (wl == 0) & (wh == 1) & np.isin(rl, list(ind_layers)) & (kv == 0) & s.planted
    decoy = (wl == 0) & (wh == 0) & s.planted  # head (0, 0) into every later head: K discoveries, none the circuit
    # a KV head's test: one id per writer x reader layer x reader KV head, its first row standing for it
    test = ((wl.astype(np.int64) * s.n_heads + wh) * s.n_layers + rl) * max(s.n_kv_heads or s.n_heads, 1) + kv
    _, first, inverse = np.unique(test, return_index=True, return_inverse=True)
    f = _formed(step, s)
    comps, cals = [], []
    heads = {"writer_layer": wl, "writer_head": wh, "reader_layer": rl, "reader_head": rh}
    for metric in metrics:
        magnitude = metric == "contribution"
        for space in spaces:
            for c in COMPS:
                shared = g > 1 and (metric, c) in KV_SHARED
                score = rng.uniform(0.05, 0.3, n)
                # a random model's p never below 0.5 / n: no discovery by chance (but ``stray``'s)
                p = rng.uniform(0.01 if magnitude else 0.0 if s.planted else 0.5 / n, 1.0, n)
                if c == "K":
                    if (metric, space) == TRACKING:
                        score = 0.05 + 0.2 * _k_function(wl, wh, rl, rh)
                    here = (planted_kv if shared else planted) if s.circuit_in in (None, (metric, space)) else decoy
                    score = np.where(here, 0.3 + 0.6 * f, score)
                    # a magnitude's heavy-tailed null: its largest scores are the circuit, none a discovery
                    p = np.where(here, 0.01 if magnitude else 10 ** (-1 - 5 * f), p)
                if s.stray == (metric, space, c):
                    p = np.where(np.arange(n) == n // 2, 1e-7, p)
                if s.n_null is not None:
                    p = np.maximum(p, 1 / (s.n_null + 1))
                if shared:  # one score and p per test, each query head's row carrying them
                    score, p = score[first][inverse], p[first][inverse]
                    q = _bh(p[first])[inverse]
                    n_null = len(first)
                else:
                    q, n_null = _bh(p), n
                n_null = s.n_null if s.n_null is not None else 2 * n_null
                unit = MAGNITUDE_UNITS if magnitude else 1.0
                keys = [pl.lit(v).alias(k) for k, v in (("model", s.name), ("checkpoint", ck), ("processing", "none"),
                                                        ("space", space), ("metric", metric), ("comp", c))]
                comps.append(pl.DataFrame({**heads, "score": score * unit,
                                           "baseline_gaussian_mean": None if magnitude else 0.1,
                                           "baseline_gaussian_std": None if magnitude else 0.02,
                                           "baseline_spectrum_mean": rng.uniform(0.1, 0.15, n) * unit,
                                           "baseline_spectrum_std": 0.03 * unit, "score_share": None},
                                          schema_overrides={"baseline_gaussian_mean": pl.Float64,
                                                            "baseline_gaussian_std": pl.Float64}).with_columns(keys))
                cals.append(pl.DataFrame({**heads, "test_unit": "kv_head" if shared else "query_head",
                                          "reader_kv_head": kv if shared else rh, "n_null": n_null,
                                          "p_value": p, "q_value": q}).with_columns(keys))
    return (pl.concat(comps).select(list(COMPOSITION_SCHEMA)).cast(COMPOSITION_SCHEMA),  # type: ignore[arg-type]
            pl.concat(cals).select(list(CALIBRATION_SCHEMA)).cast(CALIBRATION_SCHEMA))  # type: ignore[arg-type]


def _heads(s: Spec, ck: str, step: int | None, rng) -> pl.DataFrame:
    L, H = s.n_layers, s.n_heads
    layer, head = np.repeat(np.arange(L), H), np.tile(np.arange(H), L)
    f = _formed(step, s)
    prev = np.where((layer == 0) & (head == 1) & s.planted, 0.9, rng.uniform(0, 0.15, L * H))
    ind = np.where((layer >= max(1, (2 * L) // 3)) & (head == 0) & s.planted, 0.05 + 0.85 * f,
                   rng.uniform(0, 0.1, L * H))
    return pl.DataFrame({"model": s.name, "checkpoint": ck, "layer": layer, "head": head, "prev_token_mean": prev,
                         "prev_token_std": 0.05, "duplicate_mean": rng.uniform(0, 0.2, L * H), "duplicate_std": 0.05,
                         "induction_mean": ind, "induction_std": 0.05, "n_sequences": 32, "ablation": "zero",
                         "ablation_method": "exact", "ablation_sequences": 16,
                         "ablation_drop": np.where(ind > 0.4, 0.5, rng.normal(0, 0.02, L * H)),
                         "ablation_drop_stderr": 0.02, "clean_strength": 2.0}, schema=HEAD_SCORES_SCHEMA)


def _edges(s: Spec, ck: str, step: int | None, rng) -> pl.DataFrame:
    """Every causal edge per comp and method, measured over 16 sequences with a standard error
    around 0.01 that varies from edge to edge (log-normal, independent of the function) (two halves
    of 8, each with its own noise; the mean is theirs; p and q from the t-test):
    Q and V carry nothing (noise); K edges carry -0.3 f x ``_k_function`` and the planted K edges
    (previous-token head into the induction heads) -(0.05 + 2 f), f the formation; without
    ``s.function`` all noise. Exact patching on every edge."""
    from scipy import stats

    wl, wh, rl, rh = _pairs(s.n_layers, s.n_heads)
    g = s.n_heads // (s.n_kv_heads or s.n_heads)
    ind_layers = list(range(max(1, (2 * s.n_layers) // 3), s.n_layers))
    planted = (wl == 0) & (wh == 1) & np.isin(rl, ind_layers) & (rh == 0) & s.planted
    f = _formed(step, s)
    out = []
    for method in s.methods:
        for c in COMPS:
            true = np.zeros(len(wl))
            if c == "K" and s.function:
                true += np.where(planted, -(0.05 + 2 * f), -0.3 * f * _k_function(wl, wh, rl, rh))
            se = 0.01 * np.exp(rng.normal(0, 0.3, len(wl)))
            half_a, half_b = (true + rng.normal(0, 1, len(wl)) * se * np.sqrt(2) for _ in range(2))
            score = (half_a + half_b) / 2
            p = 2 * stats.t.sf(np.abs(score) / se, df=15)
            out.append(pl.DataFrame({"model": s.name, "checkpoint": ck, "comp": c, "writer_layer": wl, "writer_head": wh,
                                     "reader_layer": rl, "reader_head": rh, "reader_kv_head": rh // g, "method": method,
                                     "score": score, "score_stderr": se, "score_half_a": half_a, "score_half_b": half_b,
                                     "p_value": p, "q_value": _bh(p),
                                     "exact": score * 1.1 + rng.normal(0, 0.002, len(wl)),
                                     "exact_stderr": 0.01, "n_sequences": 16, "exact_sample": "random"}))
    return pl.concat(out).cast(EDGE_ATTRIBUTION_SCHEMA)  # type: ignore[arg-type]


def _tokens(s: Spec, ck: str, rng, n_tokens: int = 16) -> pl.DataFrame:
    rows = []
    for role, mu in (("A", 3.0), ("B", 2.0)):
        for t in range(n_tokens):
            rows.append({"model": s.name, "checkpoint": ck, "filler_before": 10, "filler_between": 10, "token_id": t,
                         "token_text": f" tok{t}", "role": role, "n": 8, "mean": float(rng.normal(mu, 0.8)), "std": 1.0,
                         "stderr": 0.35, "near_b_id": t + 1, "near_b_cosine": 0.8, "near_b_mean": float(rng.normal(1.2, 0.5)),
                         "near_b_stderr": 0.3, "random_mean": float(rng.normal(0, 0.1)), "random_stderr": 0.05})
    return pl.DataFrame(rows, schema=INDUCTION_TOKENS_SCHEMA)


def write_suite(root: Path, specs: list[Spec], metrics=KERNEL_METRICS,
                spaces=("residual", "token"), seed: int = 0) -> Path:
    """Shards, meta.json files and ``root/atlas.duckdb`` for ``specs``; returns the database path.
    The metrics default to the kernel's: the default spaces are weight spaces, where pattern_output
    (activation space only) never is."""
    rng = np.random.default_rng(seed)
    shards: dict[str, list[Path]] = {k: [] for k in ("composition", "calibration", "head_scores", "induction_tokens",
                                                      "invariance", "metric_audit", "training_loss", "edge_attribution")}
    metas = []

    def put(view: str, df: pl.DataFrame, name: str) -> None:
        p = root / view / f"{name}.parquet"
        p.parent.mkdir(parents=True, exist_ok=True)
        write_shard(df, p, {})  # sealed, as the pipeline writes them
        shards[view].append(p)

    for s in specs:
        cks = _checkpoints(s)
        for ck, step in cks:
            key = f"{s.name}__{ck}"
            if s.n_layers > 1:
                comp, cal = _composition(s, ck, step, metrics, s.spaces or spaces, rng)
                put("composition", comp, key)
                put("calibration", cal, key)
                if s.edges:
                    put("edge_attribution", _edges(s, ck, step, rng), key)
            put("head_scores", _heads(s, ck, step, rng), key)
            put("induction_tokens", _tokens(s, ck, rng), key)
            meta = {"model": s.name, "checkpoint": ck, "checkpoint_step": step, "checkpoint_tokens": None if step is None else step * 512,
                    "architecture": "llama", "n_layers": s.n_layers, "n_heads": s.n_heads, "n_kv_heads": s.n_kv_heads or s.n_heads,
                    "d_model": 64 * s.n_heads, "d_head": 64, "d_vocab": 1000, "norm_type": "RMS", "processing": "none",
                    "quantized": s.quantized,
                    # a random model is one built from a shape (random init); a planted one stands for a trained one
                    "source_kind": "trained" if s.steps else "hub" if s.planted else "build",
                    "versions": {"torch": "2.13.0", "transformer-lens": "4.0"}}
            mp = root / "meta" / f"{key}.json"
            mp.parent.mkdir(parents=True, exist_ok=True)
            mp.write_text(json.dumps(meta))
            metas.append(mp)
        last = cks[-1][0]
        if s.n_layers > 1:
            put("invariance", pl.DataFrame([{"model": s.name, "checkpoint": last, "processing": "none", "transform": t,
                                             "metric": m, "space": sp, "comp": c,
                                             "spearman": 1.0 if sp != "residual" or t in ("permutation", "orthogonal") else 0.8,
                                             "max_abs_change": 1e-3, "top_k": 20, "top_k_overlap": 0.9, "top_k_kept": True,
                                             "log10_scale_range": 2.0}
                                            for t in ("permutation", "orthogonal", "diagonal", "gl") for m in metrics
                                            for sp in s.spaces or spaces for c in COMPS], schema=INVARIANCE_SCHEMA), f"{s.name}__{last}")
        if s.steps:
            steps = np.arange(1, s.steps[-1] + 1)
            mid = s.steps[len(s.steps) // 2]
            put("training_loss", pl.DataFrame({"model": s.name, "step": steps, "tokens": steps * 512,
                                               "loss": 6 - 3 / (1 + np.exp(-(steps - mid) / max(mid / 8, 1)))},
                                              schema=TRAINING_LOSS_SCHEMA), s.name)
    put("metric_audit", pl.DataFrame([{"metric": m, "space": sp, "axiom": a, "construction": "identity d=16",
                                       "value": 0.25, "expected": 1.0, "passed": sp == "token", "detail": "{}"}
                                      for m in metrics for sp in spaces for a in ("axiom1_full", "axiom4_invariant")],
                                     schema=METRIC_AUDIT_SCHEMA), "audit")
    db = root / "atlas.duckdb"
    # as the pipeline's atlas rule builds it (scripts/atlas.py), function_agreement and function_bootstrap included
    build_atlas(db, {k: v for k, v in shards.items() if v}, metas, computed=agreement_tables)
    return db


DEFAULT_SPACES = ("residual", "token", "token_norm", "activation")


def default_run() -> list[Spec]:
    """The default run's models in shape (config/config.yaml), for write_suite(..., spaces=DEFAULT_SPACES)."""
    return [Spec("smollm2-like", 30, 9, n_kv_heads=3, edges=True, methods=("eap",), quantized=True),
            Spec("toy-gpt2", 4, 8, planted=False, stray=("frobenius", "token_norm", "Q")),
            Spec("toy-llama-gqa", 4, 8, n_kv_heads=2, planted=False),
            Spec("induction-2l", 2, 2, steps=list(range(0, 801, 100)), spaces=("residual", "token", "activation"), n_null=4)]


def as_older_atlas(db: Path) -> duckdb.DuckDBPyConnection:
    """``db`` opened read-write to be made into an atlas of an older build (views changed by
    hand): without ``shard_files``, the atlas's checksum and its sealed last-good copy, which older
    builds did not write, so that ``atlas.connect`` reads it as it is instead of as changed since it
    was built (or, unsealed beside a sealed last-good copy, answered from that copy)."""
    checksum_path(db).unlink(missing_ok=True)
    for f in (last_good_path(db), checksum_path(last_good_path(db))):
        f.unlink(missing_ok=True)
    con = duckdb.connect(str(db))
    con.execute("DROP TABLE IF EXISTS shard_files")
    return con
