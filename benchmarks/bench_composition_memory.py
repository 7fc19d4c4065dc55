"""Peak memory of a composition job: reading the layers its block touches vs the whole shard.

A weight shard at Llama-2-70B shapes is 80 layers x 0.6 GB of float32 attention weights plus
W_E and W_U. A composition job scores one block of layer pairs; ``load_weights(layers=...)``
reads only the layers those pairs touch (safetensors slices). This script writes a shard with
the 70B per-layer shapes (d_model 8192, 64 query / 8 KV heads, d_head 128) but fewer layers
(``--layers``, default 8) and a smaller vocabulary, then loads it in a fresh child process
twice: whole (the reference, today's path before this change) and the 2 layers of a one-pair
block. Each child's peak RSS is its ``ru_maxrss``, with the bytes of what it holds beside it.

    .venv/bin/python benchmarks/bench_composition_memory.py [--layers 8] [--keep DIR]

Prints the ratio of the block's peak to the whole shard's; the block's peak should stay near
the bytes of its 2 layers plus the per-model tensors, whatever the layer count.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

D_MODEL, N_HEADS, N_KV, D_HEAD, D_VOCAB = 8192, 64, 8, 128, 4096


def write_shard(folder: Path, n_layers: int) -> int:
    import torch

    from compatlas.models.weights import AttentionWeights, save_weights

    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    w = AttentionWeights(W_Q=r(n_layers, N_HEADS, D_MODEL, D_HEAD), W_K=r(n_layers, N_KV, D_MODEL, D_HEAD),
                         W_V=r(n_layers, N_KV, D_MODEL, D_HEAD), W_O=r(n_layers, N_HEADS, D_HEAD, D_MODEL),
                         W_E=r(D_VOCAB, D_MODEL), ln1_w=1 + 0.1 * r(n_layers, D_MODEL), meta={"norm_type": "RMS"})
    save_weights(w, folder / "weights.safetensors", folder / "meta.json")
    return (folder / "weights.safetensors").stat().st_size


def child(folder: Path, layers: str) -> None:
    from compatlas.models.weights import load_weights

    t0 = time.perf_counter()
    w = load_weights(folder / "weights.safetensors", folder / "meta.json",
                     layers=None if layers == "all" else [int(x) for x in layers.split(",")])
    tensors = (w.W_Q, w.W_K, w.W_V, w.W_O, w.W_E, w.ln1_w)
    sum(float(t.sum()) for t in tensors)  # touch every byte, as the scoring does (safetensors maps lazily)
    held = sum(t.numel() * t.element_size() for t in tensors)
    print(json.dumps({"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "held": held,
                      "seconds": time.perf_counter() - t0}))


def measure(folder: Path, layers: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", str(folder), layers], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--keep", type=Path, help="write the shard here and keep it")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--write", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(Path(args.child[0]), args.child[1])
        return 0
    if args.write:
        print(write_shard(args.write, args.layers))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        # written by a child: ru_maxrss survives fork and exec, so this process must stay small
        size = int(subprocess.run([sys.executable, __file__, "--write", str(folder), "--layers", str(args.layers)],
                                  check=True, capture_output=True, text=True).stdout.split()[-1])
        gib = 2**30
        print(f"shard: {args.layers} layers at Llama-2-70B attention shapes, {size / gib:.2f} GiB")
        whole, block = measure(folder, "all"), measure(folder, "3,4")
        for name, m in (("whole shard (reference)", whole), ("block of layers 3, 4", block)):
            print(f"{name:26s} peak RSS {m['peak'] / gib:6.2f} GiB, holds {m['held'] / gib:6.2f} GiB, "
                  f"{m['seconds']:5.1f} s (incl. the shard's sha256)")
        print(f"ratio block / whole: {block['peak'] / whole['peak']:.2f}x peak RSS "
              f"(the layers alone: {2 / args.layers:.2f}x of the per-layer bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
