#!/usr/bin/env python
"""What the calibrated null costs: a composition job with and without its non-causal pairs.

Usage::

    python benchmarks/bench_null_cost.py [--weights W.safetensors --meta meta.json] [--repeats 3]
                                         [--metrics frobenius,...] [--spaces residual,...]

Per metric x space, in one process, one after the other: ``score_block`` over the causal
pairs of the whole model (what a one-block composition job did before the null), then over
the causal plus ``null_pairs`` (what it does now), then ``calibrate`` on the result. Prints
the median of ``--repeats`` runs of each and the ratio (target: at most 2.5x). Without
``--weights`` the model is random with SmolLM2-135M's shapes (30 layers, 9 query / 3 KV heads,
d_model 576, d_head 64, vocab 49,152); pass an extracted model
(``results/weights/<model>/<checkpoint>/weights.safetensors`` and its ``meta.json``) to time
a real one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import polars as pl
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compatlas.composition.calibration import calibrate  # noqa: E402
from compatlas.composition.scores import layer_pairs, null_pairs  # noqa: E402
from compatlas.composition.table import score_block  # noqa: E402
from compatlas.models.weights import AttentionWeights, load_weights  # noqa: E402

TARGET = 2.5


def smollm2_shaped(seed: int = 0) -> AttentionWeights:
    g = torch.Generator().manual_seed(seed)
    L, H, Hkv, d, dh, vocab = 30, 9, 3, 576, 64, 49152

    def randn(*shape):
        return torch.randn(*shape, generator=g) / shape[-2] ** 0.5

    return AttentionWeights(W_Q=randn(L, H, d, dh), W_K=randn(L, Hkv, d, dh), W_V=randn(L, Hkv, d, dh),
                            W_O=randn(L, H, dh, d), W_E=randn(vocab, d), W_U=randn(d, vocab),
                            ln1_w=torch.ones(L, d), meta={"model": "smollm2-shaped", "norm_type": "RMS"})


def timed(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights")
    ap.add_argument("--meta")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--metrics", default="frobenius,svd_bound,subspace")
    ap.add_argument("--spaces", default="residual,token")
    args = ap.parse_args()
    w = load_weights(args.weights, args.meta) if args.weights else smollm2_shaped()
    layers = list(range(w.n_layers))
    causal_pairs, all_pairs = layer_pairs(layers), layer_pairs(layers) + null_pairs(layers, 1, 0)
    print(f"model {w.meta.get('model')}: {w.n_layers} layers x {w.n_heads} heads, d_model {w.d_model}; "
          f"torch threads {torch.get_num_threads()}; median of {args.repeats}")
    print(f"{'metric':<10} {'space':<10} {'causal s':>9} {'+null s':>9} {'calibrate s':>12} {'ratio':>6}")
    worst = 0.0
    for metric in args.metrics.split(","):
        for space in args.spaces.split(","):
            def run(pairs):
                return score_block(w, metric, space, pairs, device="cpu")[0]
            t_causal, _ = timed(lambda: run(causal_pairs), args.repeats)
            t_all, df = timed(lambda: run(all_pairs), args.repeats)
            is_causal = pl.col("writer_layer") < pl.col("reader_layer")
            t_cal, _ = timed(lambda: calibrate(df.filter(is_causal), df.filter(~is_causal),
                                               kv_group=w.n_heads // w.n_kv_heads), args.repeats)
            worst = max(worst, (t_all + t_cal) / t_causal)
            print(f"{metric:<10} {space:<10} {t_causal:9.2f} {t_all:9.2f} {t_cal:12.2f} {(t_all + t_cal) / t_causal:6.2f}")
    print(f"worst ratio (composition with null + its calibration) / (composition without): {worst:.2f} "
          f"(target <= {TARGET}) -> {'met' if worst <= TARGET else 'MISSED'}")
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
