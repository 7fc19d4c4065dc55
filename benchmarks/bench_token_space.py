"""Token space vs residual space: the cost of a whole model's composition, same run.

Target: token space costs at most 1.5x residual space. Token space pays one QR of
W_E per model (the factor is stored at extraction) and one basis change per job; the kernel
is the same. Timed: score_block over every layer pair (scores + both nulls), per metric.

    python benchmarks/bench_token_space.py [--shape smollm2|gpt2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from compatlas.composition.scores import layer_pairs
from compatlas.composition.table import score_block
from compatlas.composition.token_space import add_space_factors
from compatlas.models.weights import AttentionWeights
from compatlas.vocab import METRICS

SHAPES = {  # layers, heads, kv heads, d_model, d_head, vocab
    "smollm2": (30, 9, 3, 576, 64, 49152),
    "gpt2": (12, 12, 12, 768, 64, 50257),
}


def random_model(L: int, H: int, Hkv: int, d: int, dh: int, vocab: int) -> AttentionWeights:
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return AttentionWeights(W_Q=r(L, H, d, dh), W_K=r(L, Hkv, d, dh), W_V=r(L, Hkv, d, dh), W_O=r(L, H, dh, d),
                            W_E=r(vocab, d), meta={"model": "bench", "norm_type": "RMS"})


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="auto")
    args = p.parse_args()
    w = random_model(*SHAPES[args.shape])
    pairs = layer_pairs(list(range(w.n_layers)))
    t = time.perf_counter()
    add_space_factors(w)  # the once-per-model QR of W_E (and of its normalised rows)
    factor_s = time.perf_counter() - t
    rows = {}
    for metric in METRICS:
        res = timed(lambda: score_block(w, metric, "residual", pairs, device=args.device), args.repeats)
        tok = timed(lambda: score_block(w, metric, "token", pairs, device=args.device), args.repeats)
        rows[metric] = {"residual_s": res, "token_s": tok}
    res_total = sum(r["residual_s"] for r in rows.values())
    tok_total = sum(r["token_s"] for r in rows.values()) + factor_s / 2  # the factor step covers token and token_norm
    ratio = tok_total / res_total
    print(f"{args.shape}: {w.n_layers} layers x {w.n_heads} heads ({w.n_kv_heads} KV), d_model {w.d_model}, "
          f"d_head {w.d_head}, vocab {w.d_vocab}; {len(pairs)} layer pairs; device {args.device}; "
          f"median of {args.repeats}")
    print(f"{'metric':<10} {'residual s':>11} {'token s':>9} {'ratio':>6}")
    for m, r in rows.items():
        print(f"{m:<10} {r['residual_s']:>11.2f} {r['token_s']:>9.2f} {r['token_s'] / r['residual_s']:>6.2f}")
    print(f"QR of W_E once per model (token + token_norm): {factor_s:.2f} s, half charged to token space")
    print(f"whole model, all metrics: residual {res_total:.2f} s, token {tok_total:.2f} s, "
          f"ratio {ratio:.2f} (target <= 1.5): {'PASS' if ratio <= 1.5 else 'FAIL'}")
    out = Path(__file__).parent / "results" / f"token-space-{args.shape}-{platform.node()}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"shape": args.shape, "per_metric": rows, "factor_s": factor_s, "residual_total_s": res_total,
                               "token_total_s": tok_total, "ratio": ratio, "torch": torch.__version__,
                               "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1))


if __name__ == "__main__":
    main()
