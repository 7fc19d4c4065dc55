"""Every composition score of one model against a resolved function, on the statistics a noise
scale cannot win, beside the two oracles (docs/edge_attribution.md#noise-aware-agreement).

Reads the model's composition scores (every metric x space of an atlas, K/V edges as the largest
of their KV group's query heads, as ``composition_vs_function`` does) and a function measured
with many sequences by ``benchmarks/edge_noise_ceiling.py --save`` (each edge's mean attribution,
standard error and split halves). Per comp and cell, with 95% paired-bootstrap intervals
(``agreement.bootstrap_noise_aware``, 200 replicates):

- ``spearman_unbiased``: Spearman with half_a x half_b (unbiased for the squared function);
- ``within``: the mean over layer pairs of that Spearman among one layer pair's edges;
- ``spearman_t``: Spearman with |t| = |mean| / standard error;
- ``auroc_significant``: AUROC for the edges whose attribution differs from 0 (t-test,
  Benjamini-Hochberg q <= 0.05);
- ``beats_scale``: the paired difference to the scale oracle (the edge's standard error) above 0
  beyond its interval; ``depth``: the same against the layer pair's mean |attribution|.

    python benchmarks/agreement_candidates.py --atlas results/atlas.duckdb --model smollm2-135m \\
        --function eap4096.npz --method eap --sequences 4096 [--json out.json] \
        [--extra pattern_output=po_stdlib.npz ...]

``--extra NAME=PATH`` adds a candidate score not (yet) in the atlas: an npz of
``<key>_<comp>`` arrays [L, H, L, H] per query head (``benchmarks/pattern_output_candidate.py``
writes ``pattern_output_<comp>``), a K/V edge's the largest of its group's, as for the atlas's.
Prints a markdown table per comp and, with ``--json``, every figure.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from scipy import stats

from compatlas.atlas import connect
from compatlas.function import agreement as ag
from compatlas.vocab import COMPS


def edge_grid(L: int, H: int, width: int) -> tuple[np.ndarray, ...]:
    """The causal edges' (writer layer, writer head, reader layer, reader unit) in [L, H, L, width] C order."""
    wl, wh, rl, ru = np.meshgrid(np.arange(L), np.arange(H), np.arange(L), np.arange(width), indexing="ij")
    keep = wl < rl
    return wl[keep], wh[keep], rl[keep], ru[keep]


def composition_cells(con, model: str, comp: str, L: int, H: int, group: int) -> dict[tuple[str, str], np.ndarray]:
    """Every metric x space's score per causal edge unit ([L, H, L, width] flattened causal order)."""
    width = H if comp == "Q" else H // group
    unit = "reader_head" if comp == "Q" else f"reader_head // {group}"
    rows = con.execute(f"""SELECT metric, space, writer_layer, writer_head, reader_layer, {unit} AS unit, max(score)
                           FROM composition WHERE model = ? AND comp = ? AND writer_layer < reader_layer
                           GROUP BY ALL""", [model, comp]).fetchall()
    out: dict[tuple[str, str], np.ndarray] = {}
    for m, s, wl, wh, rl, u, v in rows:
        out.setdefault((m, s), np.full((L, H, L, width), np.nan))[wl, wh, rl, u] = np.nan if v is None else v
    causal = (np.arange(L)[:, None] < np.arange(L)[None, :])[:, None, :, None] & np.ones((L, H, L, width), bool)
    return {k: v[causal] for k, v in sorted(out.items())}


def within_pairs(score: np.ndarray, target: np.ndarray, wl: np.ndarray, rl: np.ndarray) -> float:
    rhos = []
    for a, b in set(zip(wl.tolist(), rl.tolist())):
        m = (wl == a) & (rl == b)
        if m.sum() >= 3 and np.ptp(score[m]) > 0 and np.ptp(target[m]) > 0:
            rhos.append(stats.spearmanr(score[m], target[m]).statistic)
    return float(np.mean(rhos)) if rhos else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--atlas", default="results/atlas.duckdb")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--function", required=True, help="an npz of benchmarks/edge_noise_ceiling.py --save")
    p.add_argument("--method", default="eap")
    p.add_argument("--sequences", type=int, required=True, help="the sequences the function was measured over")
    p.add_argument("--json", default="")
    p.add_argument("--extra", action="append", default=[], help="NAME=PATH of an npz of per-head-pair scores")
    args = p.parse_args()
    extras = {name: np.load(path) for name, path in (e.split("=", 1) for e in args.extra)}
    fn = np.load(args.function)
    con = connect(args.atlas)
    L, H, n_kv = con.execute("SELECT n_layers, n_heads, n_kv_heads FROM models WHERE model = ? LIMIT 1",
                             [args.model]).fetchone()
    group = H // n_kv
    out: dict = {}
    for c in COMPS:
        width = H if c == "Q" else n_kv
        causal = (np.arange(L)[:, None] < np.arange(L)[None, :])[:, None, :, None] & np.ones((L, H, L, width), bool)
        mean, se, a, b = (fn[f"{args.method}_{c}_{k}"][causal] for k in ("mean", "stderr", "half_a", "half_b"))
        wl, _, rl, _ = edge_grid(L, H, width)
        cells = composition_cells(con, args.model, c, L, H, group)
        for name, arrays in extras.items():
            key = next(k for k in arrays.files if k.endswith(f"_{c}"))
            per_head = arrays[key]  # [L, H, L, H]
            unit = per_head if c == "Q" else per_head.reshape(L, H, L, n_kv, group).max(-1)
            cells[(name, "candidate")] = unit[causal]
        depth = np.zeros_like(mean)
        for x, y in set(zip(wl.tolist(), rl.tolist())):
            m = (wl == x) & (rl == y)
            depth[m] = np.abs(mean[m]).mean()
        cells |= {("oracle_scale", "oracle"): se, ("oracle_depth", "oracle"): depth}
        names = list(cells)
        scores = np.stack([cells[k] for k in names])
        q = ag.bh_q_values(ag.edge_p_values(mean, se, args.sequences))
        sig = q <= 0.05
        res = ag.bootstrap_noise_aware(scores, a, b, sig)
        lo, hi = res.interval("spearman")
        alo, ahi = res.interval("auroc")
        t = np.abs(mean) / se
        scale = names.index(("oracle_scale", "oracle"))
        depth_i = names.index(("oracle_depth", "oracle"))
        rows = []
        for i, k in enumerate(names):
            def beats(j: int, i: int = i, boot: np.ndarray = res.spearman_boot) -> bool:
                d = boot[i] - boot[j]
                return bool(np.quantile(d[np.isfinite(d)], 0.025) > 0)
            ok = np.isfinite(scores[i])
            rows.append({"metric": k[0], "space": k[1], "spearman_unbiased": float(res.spearman[i]),
                         "interval": [float(lo[i]), float(hi[i])],
                         "within": within_pairs(scores[i][ok], (a * b)[ok], wl[ok], rl[ok]),
                         "spearman_t": float(stats.spearmanr(scores[i][ok], t[ok]).statistic),
                         "auroc_significant": float(res.auroc[i]), "auroc_interval": [float(alo[i]), float(ahi[i])],
                         "beats_scale": None if i in (scale, depth_i) else beats(scale),
                         "beats_depth": None if i in (scale, depth_i) else beats(depth_i),
                         "auroc_beats_scale": None if i in (scale, depth_i) else beats(scale, boot=res.auroc_boot)})
        out[c] = {"edges": len(mean), "significant": int(sig.sum()), "cells": rows}
        print(f"\n{c}: {len(mean):,} edges, {int(sig.sum()):,} significant (q <= 0.05 over {args.sequences} sequences)")
        print("| metric | space | Spearman, unbiased [95%] | within a layer pair | Spearman with abs(t) | "
              "AUROC, significant [95%] | Spearman beats scale / depth oracle | AUROC beats scale oracle |")
        print("|---|---|---|---|---|---|---|---|")
        for r in sorted(rows, key=lambda r: -r["spearman_unbiased"]):
            yn = {True: "yes", False: "no", None: ""}
            b_ = "" if r["beats_scale"] is None else f"{yn[r['beats_scale']]} / {yn[r['beats_depth']]} | {yn[r['auroc_beats_scale']]}"
            print(f"| {r['metric']} | {r['space']} | {r['spearman_unbiased']:.2f} [{r['interval'][0]:.2f}, "
                  f"{r['interval'][1]:.2f}] | {r['within']:.2f} | {r['spearman_t']:.2f} | {r['auroc_significant']:.2f} "
                  f"[{r['auroc_interval'][0]:.2f}, {r['auroc_interval'][1]:.2f}] | {b_ or ' |'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
