"""The composition table of one job: a block of layer pairs scored, with both nulls, as rows.

``composition`` is the kernel (per-head factors, one GEMM per layer pair); this module is the
unit of work of the composition rule around it: the job's space, device and dtype, the null
baselines' draws, and the flattening of [H, H] score blocks into ``COMPOSITION_SCHEMA`` rows."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import TYPE_CHECKING

import numpy as np
import polars as pl
import torch

from compatlas.activation_space import activation_weights
from compatlas.composition import (
    gaussian_baseline, haar_overlap_blocks, head_factors, layer_pair_scores, spectrum_baseline, touched_layers,
)
from compatlas.runtime import resolve_device, stable_seed
from compatlas.tables import COMPOSITION_SCHEMA
from compatlas.token_space import to_space
from compatlas.vocab import COMPS, NORMALISED_METRICS, Metric, Space
from compatlas.weights import AttentionWeights

if TYPE_CHECKING:
    from compatlas.moments import Moments

log = logging.getLogger(__name__)

def score_block(w: AttentionWeights, metric: Metric, space: Space, pairs: list[tuple[int, int]], *,
                baseline_samples: int = 32, seed: int = 0, device: str = "auto", dtype: str = "float32",
                max_condition: float = 1e6, moments: Moments | None = None) -> tuple[pl.DataFrame, dict]:
    """Q/K/V scores and both nulls for every head pair of the given (writer, reader) layer pairs.

    Any pair is scored the same way, causal (writer layer < reader layer) or not: the
    anti-causal and same-layer pairs of ``composition.null_pairs`` are the empirical null of
    ``calibration``. A head is never paired with itself. The ``activation`` space needs the
    model's ``moments`` (``compatlas.moments``). ``contribution`` rows carry ``score_share``, the
    score over the reader's own logit (Q, K) or output (V) RMS on the same statistics, and no
    Gaussian null (random factors of unit scale say nothing of a magnitude's units). Returns the
    table (columns ``COMPOSITION_SCHEMA``) and facts for the provenance record."""
    dev, dt = resolve_device(device), getattr(torch, dtype)
    t0 = time.perf_counter()
    # factor only the layers this job's pairs touch: at 70B shapes all 80 layers' factors are ~86 GB
    touched = touched_layers(pairs) or list((w.layer_ids or range(w.n_layers))[:1])
    local = {layer: i for i, layer in enumerate(touched)}
    grams, own = None, None
    if space == "activation":
        if moments is None:
            raise ValueError("the activation space needs the model's moments (the moments rule's output)")
        w_s, grams, own, facts = activation_weights(w.layers(touched).to(dev, dt), moments.layers(touched))
    else:
        w_s, facts = to_space(w.layers(touched), space, max_condition)
        w_s = w_s.to(dev, dt)
    f = head_factors(w_s, metric, grams=grams)
    if own is None:
        own = f.reader_norm  # every moment the identity: the reader's own QK / OV norm
    d_model, d_head, H = w_s.d_model, w.d_head, w.n_heads  # d_model of the space (token space may drop directions)
    P2 = {c: haar_overlap_blocks(d_model, d_head, baseline_samples, stable_seed(seed, "spectrum", metric, space, c),
                                 device=dev).pow(2).to(dt) for c in COMPS}
    gauss = {c: gaussian_baseline(metric, c, d_model, d_head, baseline_samples,
                                  stable_seed(seed, "gaussian", d_model, d_head, metric, c), dt, dev)
             if metric in NORMALISED_METRICS else (float("nan"), float("nan")) for c in COMPS}
    by_writer: dict[int, list[int]] = defaultdict(list)
    for l1, l2 in pairs:
        by_writer[l1].append(l2)
    cols: dict[str, list[np.ndarray]] = defaultdict(list)
    hw, hr = np.meshgrid(np.arange(H), np.arange(H), indexing="ij")
    n = H * H
    for l1, readers in sorted(by_writer.items()):
        for c in COMPS:
            a, bs = local[l1], [local[r] for r in readers]
            s_t = layer_pair_scores(f, a, bs, c)
            s = s_t.double().cpu().numpy()
            share = (s_t / own[c][bs][:, None, :]).double().cpu().numpy() if metric == "contribution" else None
            # the spectrum null of every reader layer at once: [H1, nR x H2] -> [nR, H1, H2]
            mus, sds = (x.view(H, len(bs), H).transpose(0, 1).double().cpu().numpy() for x in spectrum_baseline(
                metric, f.writer_norm[a], f.writer_sv[a], f.reader_norm[c][bs].reshape(-1),
                f.reader_sv[c][bs].reshape(len(bs) * H, -1), P2[c]))
            for i, l2 in enumerate(readers):
                keep = hw.ravel() != hr.ravel() if l1 == l2 else np.ones(n, dtype=bool)  # a head is no pair with itself
                k = int(keep.sum())
                cols["comp"].append(np.full(k, c))
                cols["writer_layer"].append(np.full(k, l1))
                cols["writer_head"].append(hw.ravel()[keep])
                cols["reader_layer"].append(np.full(k, l2))
                cols["reader_head"].append(hr.ravel()[keep])
                cols["score"].append(s[i].ravel()[keep])
                cols["score_share"].append(share[i].ravel()[keep] if share is not None else np.full(k, np.nan))
                cols["baseline_gaussian_mean"].append(np.full(k, gauss[c][0]))
                cols["baseline_gaussian_std"].append(np.full(k, gauss[c][1]))
                cols["baseline_spectrum_mean"].append(mus[i].ravel()[keep])
                cols["baseline_spectrum_std"].append(sds[i].ravel()[keep])
        log.info("%s/%s: writer layer %d scored against %d reader layers (%.1fs)", metric, space, l1, len(readers),
                 time.perf_counter() - t0)
    data = {k: np.concatenate(v) if v else np.array([]) for k, v in cols.items()}
    rows = len(data.get("score", []))
    const = {"model": w.meta.get("model", "?"), "checkpoint": w.meta.get("checkpoint", "final"),
             "processing": w.meta.get("processing", "none"), "space": space, "metric": metric}
    df = (pl.DataFrame({**{k: [v] * rows for k, v in const.items()}, **data}, schema_overrides=COMPOSITION_SCHEMA)
          if rows else pl.DataFrame(schema=COMPOSITION_SCHEMA))
    df = df.select(list(COMPOSITION_SCHEMA)).cast(COMPOSITION_SCHEMA).with_columns(
        pl.col("score_share", "baseline_gaussian_mean", "baseline_gaussian_std").fill_nan(None))
    facts.update(device=str(dev), dtype=dtype, baseline_samples=baseline_samples, seed=seed,
                 seconds=round(time.perf_counter() - t0, 3), layer_pairs=[list(p) for p in pairs])
    return df, facts
