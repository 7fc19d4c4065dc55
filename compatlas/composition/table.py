"""The composition table of one job: a block of layer pairs scored, with both nulls, as rows.

``composition`` is the kernel (per-head factors and the metrics), ``composition_job`` runs it on
the job's device in few large GEMMs; this module is the unit of work of the composition rule
around them: the job's space, device and precision, its one copy back to the host, and the
flattening of the [pair, H, H] score blocks into ``COMPOSITION_SCHEMA`` rows (vectorised: no
Python loop per layer pair)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl
import torch

from compatlas.composition.activation_space import activation_weights
from compatlas.composition.job import JobClock, score_tiles
from compatlas.composition.job_factors import job_factors
from compatlas.composition.nulls import draw_nulls
from compatlas.composition.precision import storage_dtype
from compatlas.composition.scores import touched_layers
from compatlas.composition.token_space import EmbeddingBasis, change_basis, space_basis
from compatlas.models.weights import AttentionWeights
from compatlas.runtime import resolve_device
from compatlas.tables import COMPOSITION_SCHEMA
from compatlas.vocab import ACTIVATION_ONLY_METRICS, COMPS, NORMALISED_METRICS, Metric, ScoreDtype, Space

if TYPE_CHECKING:
    from compatlas.composition.moments import Moments

log = logging.getLogger(__name__)


def score_block(w: AttentionWeights, metric: Metric, space: Space, pairs: list[tuple[int, int]], *,
                baseline_samples: int = 32, seed: int = 0, device: str = "auto", dtype: ScoreDtype = "float32",
                max_condition: float = 1e6, moments: Moments | None = None) -> tuple[pl.DataFrame, dict]:
    """Q/K/V scores and both nulls for every head pair of the given (writer, reader) layer pairs.

    Any pair is scored the same way, causal (writer layer < reader layer) or not: the
    anti-causal and same-layer pairs of ``composition.null_pairs`` are the empirical null of
    ``calibration``. A head is never paired with itself. The ``activation`` space needs the
    model's ``moments`` (``compatlas.composition.moments``). ``contribution`` rows carry ``score_share``, the
    score over the reader's own logit (Q, K) or output (V) RMS on the same statistics, and no
    Gaussian null (random factors of unit scale say nothing of a magnitude's units).
    ``pattern_output`` (activation space only) is read from the moments, where the moments rule
    measured it (``pattern_output_table``). Returns the table (columns ``COMPOSITION_SCHEMA``) and
    facts for the provenance record. One metric of ``score_space``."""
    tables, facts = score_space(w, (metric,), space, pairs, baseline_samples=baseline_samples, seed=seed,
                                device=device, dtype=dtype, max_condition=max_condition, moments=moments)
    return tables[metric], facts


def on_device(w: AttentionWeights, dev: torch.device, dt: torch.dtype) -> AttentionWeights:
    """The weights a job reads, moved once: per-layer tensors and W_E in ``dt``, the token-space
    factors kept in float64 (the basis change is sensitive to conditioning), W_U left behind."""
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=dev, dtype=dt)

    return AttentionWeights(W_Q=cast(w.W_Q), W_K=cast(w.W_K), W_V=cast(w.W_V), W_O=cast(w.W_O),
                            W_E=None if w.W_E is None else cast(w.W_E), ln1_w=None if w.ln1_w is None else cast(w.ln1_w),
                            meta=w.meta, extras={k: v.to(dev) for k, v in w.extras.items()},
                            layer_ids=w.layer_ids)


def score_space(w: AttentionWeights, metrics: tuple[Metric, ...], space: Space, pairs: list[tuple[int, int]], *,
                baseline_samples: int = 32, seed: int = 0, device: str = "auto", dtype: ScoreDtype = "float32",
                max_condition: float = 1e6, moments: Moments | None = None,
                tile_bytes: int | None = None, share_cores: bool = True) -> tuple[dict[Metric, pl.DataFrame], dict]:
    """``score_block`` for several metrics of one space in one pass: the weights go to the device
    a few layers at a time, metrics of one ``factor_family`` share their factors and core
    products, and the finished block comes back in one copy. Returns each metric's table and the
    job's facts (``seconds_by_phase``: where the time went, ``composition_job.JobClock``).

    A metric's numbers do not depend on the metrics beside it, bit for bit what ``score_block``
    gives alone: with ``share_cores`` (the default) the magnitude family's cores are always
    sandwiches of subspace's (``job_factors``: one family's d_model-long GEMMs, subspace's bases
    made where subspace is not scored), without it each family's come from its own GEMMs (the
    same values to float rounding)."""
    metrics = tuple(metrics)
    if forward := [m for m in metrics if m in ACTIVATION_ONLY_METRICS]:  # measured by the moments rule
        t0 = time.perf_counter()
        tables: dict[Metric, pl.DataFrame] = {m: pattern_output_table(w.meta, pairs, moments, space) for m in forward}
        facts: dict = {"pattern_output": "the moments rule's forward pass (compatlas.composition.pattern_output)",
                       "moments_positions": None if moments is None else moments.meta.get("positions"),
                       "seconds": round(time.perf_counter() - t0, 3), "layer_pairs": [list(p) for p in pairs]}
        kernel = tuple(m for m in metrics if m not in forward)
        if not kernel:
            return tables, facts
        more, facts = score_space(w, kernel, space, pairs, baseline_samples=baseline_samples, seed=seed, device=device,
                                  dtype=dtype, max_condition=max_condition, moments=moments, tile_bytes=tile_bytes,
                                  share_cores=share_cores)
        tables |= more
        return {m: tables[m] for m in metrics}, facts
    dev, dt = resolve_device(device), storage_dtype(dtype)
    clock, t0 = JobClock(dev), time.perf_counter()
    # factor only the layers this job's pairs touch: at 70B shapes all 80 layers' factors are ~86 GB
    touched = touched_layers(pairs) or list((w.layer_ids or range(w.n_layers))[:1])
    local = {layer: i for i, layer in enumerate(touched)}
    w_t = w.layers(touched)
    own: list[dict] = []  # the activation space's per-chunk reader RMS
    prepare, facts, d_model = _space(w_t, space, max_condition, moments, touched, dev, dt, clock, own)
    with clock.phase("factors"):  # its transfers are taken out and counted as such
        t_moved = clock.seconds["transfer"]
        factors = job_factors(w_t, metrics, prepare, share_cores=share_cores)
        clock.seconds["factors"] -= clock.seconds["transfer"] - t_moved
    # a reader's own logit / output RMS (score_share's denominator): measured, or its QK / OV norm
    own_t = (torch.stack([torch.cat([o[c] for o in own]) for c in COMPS]) if own else
             torch.stack([factors.f["frobenius"].reader_norm[c] for c in COMPS]) if "frobenius" in factors.f
             else torch.full((len(COMPS), len(touched), w.n_heads), float("nan"), dtype=dt, device=dev))
    with clock.phase("nulls"):
        nulls = draw_nulls(metrics, space, d_model, w.d_head, baseline_samples, seed, dt, dev)
    block, gauss = score_tiles(factors, metrics, [(local[a], local[b]) for a, b in pairs], nulls, dtype, clock,
                               tile_bytes)
    del factors
    with clock.phase("transfer"):  # the finished block, in one copy
        parts = [block, gauss, own_t.to(block.dtype)]
        host = torch.cat([x.flatten() for x in parts]).cpu().double().numpy()
        block_h, gauss_h, own_h = (x.reshape(p.shape) for x, p in zip(np.split(host, np.cumsum([p.numel() for p in parts])[:-1]), parts))
        del block, gauss, parts
    with clock.phase("table"):
        const = {"model": w.meta.get("model", "?"), "checkpoint": w.meta.get("checkpoint", "final"),
                 "processing": w.meta.get("processing", "none"), "space": space}
        pairs_local = [(local[a], local[b]) for a, b in pairs]
        tables = {m: block_table(block_h[i], gauss_h[i] if m in NORMALISED_METRICS else np.full_like(gauss_h[i], np.nan),
                                 pairs, w.n_heads, const | {"metric": m},
                                 share=(own_h, pairs_local) if m == "contribution" else None)
                  for i, m in enumerate(metrics)}
    log.info("%s/%s: %d layer pairs scored in %.1fs (%s)", ",".join(metrics), space, len(pairs),
             time.perf_counter() - t0, ", ".join(f"{k} {v:.2f}s" for k, v in clock.seconds.items()))
    facts.update(device=str(dev), dtype=dtype, baseline_samples=baseline_samples, seed=seed,
                 seconds=round(time.perf_counter() - t0, 3), layer_pairs=[list(p) for p in pairs],
                 seconds_by_phase={k: round(v, 3) for k, v in clock.seconds.items()})
    return tables, facts


def _space(w_t: AttentionWeights, space: Space, max_condition: float, moments: Moments | None, touched: list[int],
           dev: torch.device, dt: torch.dtype, clock: JobClock, own: list[dict]
           ) -> tuple[Callable[[AttentionWeights], tuple[AttentionWeights, dict | None]], dict, int]:
    """How a chunk of the job's layers becomes the weights the kernel factors (moved to the device
    and into the space: the device holds a chunk of weights at a time, never the job's), the
    space's facts and its d_model. The activation space's reader RMS of each chunk go to ``own``."""
    facts: dict
    basis: EmbeddingBasis | None
    if space == "activation":
        if moments is None:
            raise ValueError("the activation space needs the model's moments (the moments rule's output)")
        m_t, facts, basis = moments.layers(touched), {}, None
    else:
        with clock.phase("factors"):  # the space's basis on the device, from its factor (W_E's when none is stored)
            embedding = AttentionWeights(W_Q=w_t.W_Q[:0], W_K=w_t.W_K[:0], W_V=w_t.W_V[:0], W_O=w_t.W_O[:0],
                                         W_E=w_t.W_E, ln1_w=w_t.ln1_w, meta=w_t.meta, extras=w_t.extras)
            basis, facts = space_basis(on_device(embedding, dev, dt), space, max_condition)
    done = [0]  # layers of w_t prepared so far: the chunks come in order

    def prepare(chunk: AttentionWeights) -> tuple[AttentionWeights, dict | None]:
        with clock.phase("transfer"):
            chunk = on_device(chunk, dev, dt)
        a, done[0] = done[0], done[0] + chunk.n_layers
        if space == "activation":
            wa, grams, own_c, f = activation_weights(chunk, m_t.layers(list(range(a, done[0]))))
            facts.update(f)
            own.append(own_c)
            return wa, grams
        return (chunk if basis is None else change_basis(chunk, basis.R, basis.R_inv)), None

    return prepare, facts, w_t.d_model if basis is None else basis.R.shape[0]  # token space may drop directions


def pattern_output_table(meta: Mapping[str, Any], pairs: list[tuple[int, int]], moments: Moments | None,
                         space: Space = "activation") -> pl.DataFrame:
    """``pattern_output``'s rows for the pairs' head pairs, read from the moments (the scores of a
    forward pass: no weights are scored here, the weights' ``meta`` names the model and its heads),
    ``score_share`` the score over the reader's own output RMS on the same sample, both baselines
    null (no null model of a forward pass's change)."""
    if space != "activation":
        raise ValueError(f"pattern_output is scored in the activation space only (a forward pass's), not in {space}")
    if moments is None or moments.pattern_output is None or moments.pattern_output_own is None:
        raise ValueError("pattern_output needs its scores in the moments: rerun the moments rule with pattern_output "
                         "in the run's metrics")
    layers = touched_layers(pairs)
    local = {layer: i for i, layer in enumerate(layers)}
    H, P = int(meta["n_heads"]), len(pairs)
    block = np.full((len(COMPS), 3, P, H, H), np.nan)
    for ci, c in enumerate(COMPS):
        po = moments.pattern_output[c].numpy()
        for pi, (a, b) in enumerate(pairs):
            block[ci, 0, pi] = po[a, :, b, :]
    own = np.broadcast_to(moments.pattern_output_own[layers].numpy(), (len(COMPS), len(layers), H))
    const = {"model": meta.get("model", "?"), "checkpoint": meta.get("checkpoint", "final"),
             "processing": meta.get("processing", "none"), "space": space, "metric": "pattern_output"}
    df = block_table(block, np.full((len(COMPS), 2), np.nan), pairs, H, const,
                     share=(own, [(local[a], local[b]) for a, b in pairs]))
    return df.with_columns(pl.col("baseline_spectrum_mean", "baseline_spectrum_std").fill_nan(None))


def block_table(block: np.ndarray, gauss: np.ndarray, pairs: list[tuple[int, int]], H: int, const: dict[str, str],
                share: tuple[np.ndarray, list[tuple[int, int]]] | None = None) -> pl.DataFrame:
    """Rows (``COMPOSITION_SCHEMA``) of one metric's block [comp, score / spectrum mean / std, pair,
    H, H] and Gaussian baselines [comp, mean / std], writer layer by writer layer, then comp, then
    the pairs' order; same-layer pairs drop a head paired with itself. ``share``: each reader head's
    own RMS [comp, local layer, H] and the pairs in local layers, for ``score_share``."""
    if not pairs:
        return pl.DataFrame(schema=COMPOSITION_SCHEMA)
    wl, rl = (np.array(x) for x in zip(*pairs))
    p_i, c_i = np.meshgrid(np.arange(len(pairs)), np.arange(len(COMPS)), indexing="ij")
    order = np.lexsort((p_i.ravel(), c_i.ravel(), wl[p_i.ravel()]))  # writer, then comp, then pair
    p_i, c_i = p_i.ravel()[order], c_i.ravel()[order]
    hw, hr = np.meshgrid(np.arange(H), np.arange(H), indexing="ij")
    keep = ~((wl[p_i] == rl[p_i])[:, None, None] & (hw == hr)[None])  # [rows / H^2, H, H]
    k = keep.sum(axis=(1, 2))

    def per_block(x: np.ndarray) -> np.ndarray:  # one value per (comp, pair) block, repeated over its rows
        return np.repeat(x, k)

    def per_head(x: np.ndarray) -> np.ndarray:  # [(comp, pair) blocks, H, H] -> the kept rows
        return x[keep]

    score = block[c_i, 0, p_i]
    if share is not None:
        own, local = share
        reader = np.array([b for _, b in local])[p_i]
        share_rows = per_head(score / own[c_i, reader][:, None, :])
    else:
        share_rows = np.full(int(k.sum()), np.nan)
    data = {
        "writer_layer": per_block(wl[p_i]), "writer_head": per_head(np.broadcast_to(hw, keep.shape)),
        "reader_layer": per_block(rl[p_i]), "reader_head": per_head(np.broadcast_to(hr, keep.shape)),
        "score": per_head(score),
        "baseline_gaussian_mean": per_block(gauss[c_i, 0]), "baseline_gaussian_std": per_block(gauss[c_i, 1]),
        "baseline_spectrum_mean": per_head(block[c_i, 1, p_i]), "baseline_spectrum_std": per_head(block[c_i, 2, p_i]),
        "score_share": share_rows,
    }
    df = pl.DataFrame(data).with_columns(pl.Series("comp", COMPS).gather(per_block(c_i)),
                                         *(pl.lit(v).alias(name) for name, v in const.items()))
    return df.select(list(COMPOSITION_SCHEMA)).cast(pl.Schema(COMPOSITION_SCHEMA)).with_columns(
        pl.col("score_share", "baseline_gaussian_mean", "baseline_gaussian_std").fill_nan(None))
