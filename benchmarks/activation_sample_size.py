"""How many tokens the activation space needs: moments from two disjoint halves of the text
sample, and the rank correlation of the ``contribution`` x ``activation`` scores they give, per
comp, over every causal head pair; with the moments pass's time. Also the scores' agreement with
the model's edge attribution (EAP) for either writer statistic (its measured output E[z^T z], or
its input pushed through W_V), where the run has an edge_attribution shard.

Run after the default run (it reads the model's weight shard and boots it as the moments rule does):

    .venv/bin/python benchmarks/activation_sample_size.py [--model smollm2-135m] [--chunks 8 16 32]

Each line: chunks per half, tokens per half, Spearman between the halves for Q / K / V.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import polars as pl
import torch
import yaml

from compatlas.behaviour.induction import boot_for_forward
from compatlas.behaviour.tokens import bos_token
from compatlas.composition.activation_space import activation_weights
from compatlas.composition.moments import Moments, measure_moments
from compatlas.composition.scores import block_pairs, head_factors, layer_pair_scores
from compatlas.composition.text_sample import text_chunks
from compatlas.models.weights import load_weights
from compatlas.plan import build_plan, thaw


def ranks(x: np.ndarray) -> np.ndarray:
    return pl.Series(x).rank("average").to_numpy()


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def scores(w, m: Moments, writer: str = "output") -> dict[str, np.ndarray]:
    """contribution x activation of every causal pair, per comp, in a fixed order."""
    wa, grams, _, _ = activation_weights(w, m, writer)  # type: ignore[arg-type]
    f = head_factors(wa, "contribution", grams=grams)
    out: dict[str, list[np.ndarray]] = {c: [] for c in "QKV"}
    pairs = block_pairs(list(range(w.n_layers)), 1, 0)
    for l1 in sorted({a for a, _ in pairs}):
        readers = [b for a, b in pairs if a == l1]
        for c in "QKV":
            out[c].append(layer_pair_scores(f, l1, readers, c).flatten().numpy())
    return {c: np.concatenate(v) for c, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="config/config.yaml")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--chunks", type=int, nargs="+", default=[8, 16, 32], help="chunks per half")
    ap.add_argument("--halves", choices=["interleaved", "contiguous"], default="interleaved",
                    help="the even and odd windows of the first 2n (the same texts in both halves), or the first n "
                         "windows against the n after the largest n (other texts)")
    args = ap.parse_args()
    plan = build_plan(yaml.safe_load(Path(args.config).read_text()), check_hub=False)
    mp = plan.models[args.model]
    ck = mp.last
    res = plan.results
    w = load_weights(f"{res}/weights/{args.model}/{ck.label}/weights.safetensors",
                     f"{res}/weights/{args.model}/{ck.label}/meta.json").to("cpu", torch.float64)
    ind, act = thaw(mp.induction), thaw(mp.activation)
    booted = boot_for_forward(args.model, thaw(mp.entry), ck.spec(), ind, f"{res}/weights/{args.model}/{ck.label}/meta.json",
                              Path(f"{res}/models/{args.model}/{ck.label}"), "cpu", "moments", lambda n: None)
    bos = bos_token(booted.bridge.tokenizer, ind["prepend_bos"])
    most = max(args.chunks)
    sample = text_chunks(booted.bridge.tokenizer, act["text"], 2 * most, act["length"], bos)
    print(f"{args.model}: text {sample.facts['kind']} ({sample.facts['sha256'][:12]}), {act['length']} tokens per chunk, "
          f"{args.halves} halves")
    for n in sorted(args.chunks):
        t0 = time.perf_counter()
        parts = ([sample.tokens[i:2 * n:2] for i in (0, 1)] if args.halves == "interleaved"
                 else [sample.tokens[i * most:i * most + n] for i in (0, 1)])
        halves = [measure_moments(booted.bridge, part, act["batch_size"], bos is not None) for part in parts]
        seconds = (time.perf_counter() - t0) / 2
        a, b = scores(w, halves[0]), scores(w, halves[1])
        rho = " / ".join(f"{spearman(a[c], b[c]):.4f}" for c in "QKV")
        print(f"{n:3d} chunks ({n * act['length']:5d} tokens) per half: Spearman Q / K / V {rho}; "
              f"moments pass {seconds:.1f}s per half", flush=True)


if __name__ == "__main__":
    main()
