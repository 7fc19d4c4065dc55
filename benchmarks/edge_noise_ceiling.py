"""How many sequences edge attribution needs before it measures function rather than its noise.

Runs the edge attribution job's methods (``attribution_scores``, as the ``edge_attribution`` rule
does) on one model of a config with ``--sequences`` sequences, keeps every sequence's score, and
for a doubling series of first-n sequences prints, per comp:

- ``noise_ceiling``: the Spearman between |mean attribution| over the even and over the odd
  sequences (two independent halves; uncorrected), over every causal edge, and its mean within
  one layer pair (``noise_ceiling_within_layer_pair``): what the atlas's ``noise_ceiling`` column
  holds at that many sequences;
- ``share_t_above_3``: the share of edges whose |mean| / standard error exceeds 3;
- the seconds the attribution took (per method, all sequences).

    python benchmarks/edge_noise_ceiling.py [--config config/config.yaml] [--model smollm2-135m]
        [--sequences 512] [--length 20] [--methods eap] [--device auto] [--save edges.npz]

Prints JSON. ``--save`` writes every edge's per-comp mean, standard error and split halves at the
largest n, as numpy arrays ``<method>_<comp>_<what>`` [L, H, L, width] (for analyses of agreement
statistics outside the pipeline; numpy only, so that it runs where polars is not installed).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
import yaml
from scipy import stats

from compatlas.behaviour.tokens import clean_tokens, sample_tokens, token_directions, token_set
from compatlas.function.edge_attribution import (
    attribution_scores,
    attribution_work,
    induction_task,
    n_kv_heads,
)
from compatlas.function.edge_measure import split_halves
from compatlas.models.loading import boot
from compatlas.plan import build_plan, thaw
from compatlas.progress import Progress
from compatlas.runtime import resolve_device
from compatlas.vocab import COMPS

REPO = Path(__file__).resolve().parent.parent


def ceilings(per_seq: torch.Tensor, L: int) -> dict:
    """Split-half figures of one comp's per-sequence scores [S, L, H, L, width] (causal edges)."""
    causal = (torch.arange(L)[:, None] < torch.arange(L)[None, :])[:, None, :, None].expand(per_seq.shape[1:])
    a, b = (h[causal].numpy() for h in split_halves(per_seq))
    mean = per_seq.mean(0)[causal].numpy()
    se = (per_seq.std(0, correction=1) / per_seq.shape[0] ** 0.5)[causal].numpy()
    lw = torch.arange(L)[:, None, None, None].expand(per_seq.shape[1:])[causal].numpy()
    lr = torch.arange(L)[None, None, :, None].expand(per_seq.shape[1:])[causal].numpy()
    within = []
    for pair in set(zip(lw.tolist(), lr.tolist())):
        m = (lw == pair[0]) & (lr == pair[1])
        if m.sum() >= 3 and np.ptp(np.abs(a[m])) > 0 and np.ptp(np.abs(b[m])) > 0:
            within.append(stats.spearmanr(np.abs(a[m]), np.abs(b[m]))[0])
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.abs(mean) / se
    return {"noise_ceiling": round(float(stats.spearmanr(np.abs(a), np.abs(b))[0]), 3),
            "noise_ceiling_within_layer_pair": round(float(np.mean(within)), 3) if within else None,
            "share_t_above_3": round(float(np.mean(t > 3)), 3), "edges": int(causal.sum())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "config" / "config.yaml"))
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--sequences", type=int, default=512)
    p.add_argument("--length", type=int, default=0, help="repeated span (0: the config's)")
    p.add_argument("--methods", default="eap")
    p.add_argument("--batch-size", type=int, default=0, help="0: the config's")
    p.add_argument("--device", default="auto")
    p.add_argument("--save", default="")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    raw = yaml.safe_load(Path(args.config).read_text())
    plan = build_plan(raw, check_sources=False)
    ind = thaw(plan.models[args.model].induction)
    edge = ind["edge_attribution"]
    length = args.length or edge["length"]
    bs = args.batch_size or edge["batch_size"]
    dev = resolve_device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out: dict = {"model": args.model, "device": str(dev), "host": platform.node(), "threads": torch.get_num_threads(),
                 "sequences": args.sequences, "length": length, "batch_size": bs}
    with tempfile.TemporaryDirectory() as tmp:
        entry = thaw(plan.models[args.model].entry)
        t0 = time.perf_counter()
        model, _ = boot(entry, None, Path(tmp), str(dev))
        model.eval()
        out["boot_seconds"] = round(time.perf_counter() - t0, 1)
        with torch.no_grad():
            W_E, W_U = model.W_E.detach().float().cpu(), model.W_U.detach().float().cpu()
        clean, _ = clean_tokens(model.tokenizer, W_E, token_directions(W_E, W_U))
        tokens = token_set(model.tokenizer, sample_tokens(clean, ind["pool"], ind["seed"], "pool"), ind["prepend_bos"])
        task = induction_task(tokens, args.sequences, length, ind["seed"])
        L = model.cfg.n_layers
        arrays: dict[str, np.ndarray] = {}
        for method in args.methods.split(","):
            sync()
            t = time.perf_counter()
            scores = attribution_scores(model, task, method, edge["steps"], bs,
                                        Progress(logging.getLogger("edge_noise_ceiling"), method,
                                                 *attribution_work(model, method, args.sequences, edge["steps"])))
            sync()
            res: dict = {"seconds": round(time.perf_counter() - t, 1)}
            n = 16
            while n <= args.sequences:
                res[str(n)] = {c: ceilings(scores[c][:n], L) for c in COMPS}
                print(method, n, json.dumps({c: res[str(n)][c]["noise_ceiling"] for c in COMPS}), file=sys.stderr,
                      flush=True)
                n *= 2
            out[method] = res
            for c in COMPS:
                s = scores[c]
                ha, hb = split_halves(s)
                arrays |= {f"{method}_{c}_mean": s.mean(0).numpy(), f"{method}_{c}_half_a": ha.numpy(),
                           f"{method}_{c}_half_b": hb.numpy(),
                           f"{method}_{c}_stderr": (s.std(0, correction=1) / s.shape[0] ** 0.5).numpy()}
        out["kv_group"] = model.cfg.n_heads // n_kv_heads(model)
    if args.save:
        np.savez_compressed(args.save, **arrays)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
