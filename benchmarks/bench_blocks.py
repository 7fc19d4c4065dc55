#!/usr/bin/env python
"""What splitting a composition cell into blocks costs: one job against the sum of B jobs, for the
tiles of the layer grid (``compatlas.tiles``, what the pipeline runs) and the old contiguous
shares of the pair list (a private copy below, the reference), against the fp32 matmul floor.

Usage::

    python benchmarks/bench_blocks.py [--layers 4] [--blocks 8] [--metrics frobenius,svd_bound,contribution,subspace]
                                      [--device cpu|cuda] [--shape llama2-70b|tiny] [--json PATH]

Each job is what the composition rule runs for one block: ``score_space(w, metrics, "residual",
pairs + null)`` (``compatlas.composition.table``) on the weights ``load_weights(layers=touched)``
would give it (the layers its pairs touch, with their layer numbers), with both nulls (32 draws),
from host weights to the tables. The weights are synthetic, Gaussian with std 1 / sqrt(d_model),
at Llama-2-70B widths (d_model 8192, 64 query heads, 8 KV heads, d_head 128): a layer is drawn
from its own seed, once per run and outside the timing (a job's read of its layers is not timed
either: it adds per touched layer, which only widens the gap between schemes that touch different
numbers of layers). At 80 layers the run holds the model's 48 GB of float32 weights on the host.

Printed, all measured in this one run: per scheme and block its layer pairs (causal, mirrored,
same-layer), touched layers and seconds; one job's time (B = 1: the whole model, the same pairs in
the same order under both schemes), the sum over the B blocks' jobs and their ratio (target:
tiles <= 1.3); and the fp32 floor: the products of one layer pair in the job's own shapes as
plain GEMMs on fresh operands (per comp the d_model-long GEMM, then the post or sandwich products
the job's metrics add: ``compatlas.composition.job``), the best of a few timings, times the
number of layer pairs (every pair has the same shapes), so the floor has the jobs' total FLOPs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from compatlas.composition.scores import factor_family, layer_pairs, touched_layers  # noqa: E402
from compatlas.composition.table import score_space  # noqa: E402
from compatlas.models.weights import AttentionWeights  # noqa: E402
from compatlas.tiles import block_pairs, null_pairs  # noqa: E402
from compatlas.vocab import COMPS, KERNEL_METRICS  # noqa: E402

SHAPES = {  # n_heads, n_kv_heads, d_model, d_head
    "llama2-70b": dict(name="Llama-2-70B widths", H=64, Hkv=8, d=8192, dh=128),
    "small": dict(name="small GQA (CPU)", H=16, Hkv=2, d=1024, dh=64),
    "tiny": dict(name="tiny GQA (smoke test)", H=4, Hkv=2, d=64, dh=16),
}
DEFAULT_METRICS = ("frobenius", "svd_bound", "contribution", "subspace")
TARGET = 1.3  # tiles: the B jobs' sum over the one job


def log(msg: str) -> None:
    print(msg, flush=True)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ----------------------------------------------------------------------------- the reference: contiguous shares


def old_block_pairs(layers: list[int], blocks: int, block: int) -> list[tuple[int, int]]:
    """The layer pairs of job ``block`` before the tiles: a contiguous share of the pair list."""
    pairs = layer_pairs(layers)
    size, extra = divmod(len(pairs), blocks)
    start = block * size + min(block, extra)
    return pairs[start:start + size + (block < extra)]


def old_null_pairs(layers: list[int], blocks: int, block: int) -> list[tuple[int, int]]:
    """Its mirrors, and the same-layer pairs of layer i in job i % blocks."""
    mirrors = [(b, a) for a, b in old_block_pairs(layers, blocks, block)]
    return mirrors + [(layer, layer) for i, layer in enumerate(layers) if i % blocks == block]


SCHEMES = {"tiles": (block_pairs, null_pairs), "contiguous": (old_block_pairs, old_null_pairs)}


# ----------------------------------------------------------------------------- weights and jobs


def layer_tensors(s: dict, layer: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """W_Q, W_K, W_V, W_O of one layer, from the layer's own seed."""
    g = torch.Generator().manual_seed(seed * 100_003 + layer)
    H, Hkv, d, dh = s["H"], s["Hkv"], s["d"], s["dh"]

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / d**0.5

    return r(H, d, dh), r(Hkv, d, dh), r(Hkv, d, dh), r(H, dh, d)


_CACHE: dict[tuple[str, int], tuple[torch.Tensor, ...]] = {}


def model_layers(s: dict, n_layers: int) -> tuple[torch.Tensor, ...]:
    """W_Q, W_K, W_V, W_O of every layer, drawn once per run (80 layers at 70B widths: 48 GB)."""
    key = (s["name"], n_layers)
    if key not in _CACHE:
        _CACHE.clear()
        first = layer_tensors(s, 0)
        full = tuple(torch.empty(n_layers, *x.shape) for x in first)
        for layer in range(n_layers):  # filled in place: never two copies of the model
            for dst, src in zip(full, first if layer == 0 else layer_tensors(s, layer)):
                dst[layer] = src
        _CACHE[key] = full
    return _CACHE[key]


def job_weights(s: dict, touched: list[int], n_layers: int) -> AttentionWeights:
    """What ``load_weights(layers=touched)`` gives a job: those layers, numbered (consecutive ones
    a view of the run's layers, others a copy, as a read would make)."""
    full = model_layers(s, n_layers)
    if touched == list(range(touched[0], touched[-1] + 1)):
        W_Q, W_K, W_V, W_O = (x[touched[0]:touched[-1] + 1] for x in full)
    else:
        idx = torch.tensor(touched)
        W_Q, W_K, W_V, W_O = (x[idx] for x in full)
    return AttentionWeights(W_Q=W_Q, W_K=W_K, W_V=W_V, W_O=W_O, W_E=torch.zeros(1, s["d"]),
                            meta={"model": s["name"]}, layer_ids=tuple(touched))


def run_job(s: dict, metrics: tuple[str, ...], pairs: list[tuple[int, int]], layers: list[int],
            dev: torch.device) -> tuple[float, int]:
    """(seconds, touched layers) of one block's job; the weights are made outside the timing."""
    touched = touched_layers(pairs) or layers[:1]
    w = job_weights(s, touched, len(layers))
    sync(dev)
    t0 = time.perf_counter()
    score_space(w, metrics, "residual", pairs, baseline_samples=32, seed=0, device=dev.type, dtype="float32")
    sync(dev)
    return time.perf_counter() - t0, len(touched)


def run_scheme(s: dict, metrics: tuple[str, ...], layers: list[int], blocks: int, scheme: str,
               dev: torch.device) -> list[dict]:
    causal_of, null_of = SCHEMES[scheme]
    rows = []
    for b in range(blocks):
        pairs = causal_of(layers, blocks, b) + null_of(layers, blocks, b)
        if not pairs:
            rows.append({"block": b, "pairs": 0, "touched": 0, "s": 0.0})
            log(f"  {scheme:10s} B={blocks:<3d} block {b:3d}: no pairs (no job work)")
            continue
        sec, touched = run_job(s, metrics, pairs, layers, dev)
        rows.append({"block": b, "pairs": len(pairs), "touched": touched, "s": sec})
        log(f"  {scheme:10s} B={blocks:<3d} block {b:3d}: {len(pairs):4d} layer pairs, {touched:3d} touched layers, "
            f"{sec:8.2f} s")
    return rows


# ----------------------------------------------------------------------------- the floor


def pair_floor(s: dict, metrics: tuple[str, ...], dev: torch.device, repeats: int) -> tuple[float, float]:
    """(seconds, FLOPs) of one layer pair's products as the job runs them, as plain GEMMs on fresh
    operands: per comp the d_model-long GEMM of the base family (subspace where the job scores it,
    else the magnitude family), then a shared absorb's post products (magnitude base, GQA K and V)
    or the sandwich products of the other family (``job_factors``). Best of ``repeats``."""
    H, Hkv, d, dh = s["H"], s["Hkv"], s["d"], s["dh"]
    families = {factor_family(m) for m in metrics}
    base = "subspace" if "subspace" in families else "frobenius"
    sandwiched = len(families - {base})
    gen = torch.Generator(device=dev).manual_seed(1)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=dev)

    widths = sorted({Hkv if c != "Q" else H for c in COMPS})
    E = rand(H * dh, d)
    F = {Hg: rand(d, Hg * dh) for Hg in widths}
    post = {Hg: rand(Hg, dh, H // Hg * dh) for Hg in widths if Hg != H}
    left, right = rand(H, dh, dh), {Hg: rand(Hg, dh, H // Hg * dh) for Hg in widths}
    flops = 0.0
    for c in COMPS:
        Hg = Hkv if c != "Q" else H
        flops += 2 * H * dh * d * Hg * dh
        if base != "subspace" and Hg != H:
            flops += 2 * H * dh * dh * H * dh
        flops += sandwiched * (2 * H * dh * dh * Hg * dh + 2 * H * dh * dh * H * dh)

    def run() -> None:
        for c in COMPS:
            Hg = Hkv if c != "Q" else H
            core = E @ F[Hg]  # [H dh, Hg dh]
            if base != "subspace" and Hg != H:
                core.view(H * dh, Hg, dh).transpose(0, 1) @ post[Hg]
            for _ in range(sandwiched):
                x = (left @ core.view(H, dh, Hg * dh)).view(H * dh, Hg, dh).transpose(0, 1)
                x @ right[Hg]

    run()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        run()
        sync(dev)
        best = min(best, time.perf_counter() - t0)
    return best, flops


# ----------------------------------------------------------------------------- main


def summary(out: dict) -> None:
    """The run's totals and ratios, all against references measured in the same run."""
    one_s, floor_s, blocks = out["one_job_s"], out["floor"]["s"], out["blocks"]
    log("")
    log(f"one job (B=1): {one_s:.1f} s, {out['layers']} touched layers; {one_s / floor_s:.2f}x the fp32 floor ({floor_s:.1f} s)")
    for scheme, r in out["schemes"].items():
        verdict = f"  (target <= {TARGET}: {'met' if r['ratio'] <= TARGET else 'NOT met'})" if scheme == "tiles" else ""
        log(f"{scheme:10s} B={blocks}: sum {r['sum_s']:.1f} s over the jobs, {r['ratio']:.2f}x one job, "
            f"{r['sum_s'] / floor_s:.2f}x the floor; touched layers {r['touched_sum']} in all, at most "
            f"{r['touched_max']} a job{verdict}")
    log(f"tiles / contiguous at B={blocks}: {out['schemes']['tiles']['sum_s'] / out['schemes']['contiguous']['sum_s']:.2f}; "
        f"wall {out['wall_s']:.0f} s; load average after {out['load_avg_after'][0]:.1f}")


def job_costs(out: dict) -> tuple[float, float, float] | None:
    """(per job, per touched layer, per layer pair) seconds: least squares over the run's jobs
    (time = a + b touched + c pairs); None where the jobs do not tell the three apart."""
    import numpy as np

    jobs = [(out["layers"], out["layer_pairs"], out["one_job_s"])]
    jobs += [(r["touched"], r["pairs"], r["s"]) for sc in out["schemes"].values() for r in sc["rows"] if r["pairs"]]
    A = np.array([[1.0, t, p] for t, p, _ in jobs])
    if np.linalg.matrix_rank(A) < 3:
        return None
    c = np.linalg.lstsq(A, np.array([x for _, _, x in jobs]), rcond=None)[0]
    return float(c[0]), float(c[1]), float(c[2])


def projection(out: dict, n_layers: int, block_counts: tuple[int, ...]) -> dict:
    """Each scheme's sum over its jobs against one job at ``n_layers``, from ``job_costs`` and
    the exact touched layers and pairs of every job (arithmetic on this run's measurement)."""
    costs = job_costs(out)
    if costs is None:
        return {}
    a, b, c = costs
    layers = list(range(n_layers))

    def total(scheme: str, blocks: int) -> float:
        causal_of, null_of = SCHEMES[scheme]
        jobs = [causal_of(layers, blocks, k) + null_of(layers, blocks, k) for k in range(blocks)]
        return sum(a + b * len(touched_layers(p)) + c * len(p) for p in jobs if p)

    one = total("tiles", 1)
    rows = {blocks: {scheme: total(scheme, blocks) / one for scheme in SCHEMES} for blocks in block_counts}
    log(f"\nfrom this run's jobs: {a:.1f} s a job, {b:.1f} s a touched layer, {c:.1f} s a layer pair (least squares)")
    for blocks, r in rows.items():
        log(f"  projected at {n_layers} layers, B={blocks}: sum over the jobs / one job: tiles {r['tiles']:.3f}, "
            f"contiguous {r['contiguous']:.3f}")
    return {"per_job_s": a, "per_layer_s": b, "per_pair_s": c, "layers": n_layers, "ratios": rows}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4, help="scored layers (80: a whole Llama-2-70B, on a GPU)")
    ap.add_argument("--blocks", type=int, default=8, help="B, the jobs the cell is split into")
    ap.add_argument("--metrics", default=",".join(DEFAULT_METRICS), help=f"comma-separated, of {KERNEL_METRICS}")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--shape", choices=tuple(SHAPES), default="llama2-70b")
    ap.add_argument("--floor-repeats", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--project-layers", type=int, default=80, help="the projection's layer count (0: none)")
    ap.add_argument("--replay", type=Path, default=None, help="print a saved run's figures (its --json) and projection")
    a = ap.parse_args(argv)
    if a.replay:
        out = json.loads(a.replay.read_text())
        summary(out)
        if a.project_layers:
            out["projection"] = projection(out, a.project_layers, tuple(sorted({out["blocks"], 8, 64})))
        return out
    s, dev = SHAPES[a.shape], torch.device(a.device)
    metrics = tuple(a.metrics.split(","))
    if bad := [m for m in metrics if m not in KERNEL_METRICS]:
        ap.error(f"metrics {bad}: choose from {KERNEL_METRICS}")
    layers = list(range(a.layers))
    n_pairs = len(layer_pairs(layers)) * 2 + len(layers)
    out: dict = {"shape": s, "layers": a.layers, "blocks": a.blocks, "metrics": metrics, "layer_pairs": n_pairs,
                 "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                 "threads": torch.get_num_threads(), "torch": torch.__version__, "host": platform.node(),
                 "load_avg_before": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    log(f"{s['name']}: d_model {s['d']}, {s['H']} query / {s['Hkv']} KV heads, d_head {s['dh']}; {a.layers} layers, "
        f"{n_pairs} layer pairs (causal, mirrored, same-layer); metrics {','.join(metrics)}; residual space; "
        f"device {out['device']}, {out['threads']} threads, load average {out['load_avg_before'][0]:.1f}")
    t_start = time.perf_counter()
    floor_pair_s, pair_flops = pair_floor(s, metrics, dev, a.floor_repeats)
    floor_s = floor_pair_s * n_pairs
    out["floor"] = {"pair_s": floor_pair_s, "pair_tflop": pair_flops / 1e12, "s": floor_s,
                    "tflops": pair_flops / floor_pair_s / 1e12}
    log(f"fp32 floor: one layer pair's products {pair_flops / 1e12:.3f} TFLOP in {floor_pair_s:.2f} s "
        f"({out['floor']['tflops'] * 1e3:.0f} GFLOP/s); x {n_pairs} layer pairs = {floor_s:.1f} s")
    one = run_scheme(s, metrics, layers, 1, "tiles", dev)  # B = 1: the same job under both schemes
    assert block_pairs(layers, 1, 0) == old_block_pairs(layers, 1, 0)
    assert null_pairs(layers, 1, 0) == old_null_pairs(layers, 1, 0)
    one_s = one[0]["s"]
    out["one_job_s"] = one_s
    out["schemes"] = {}
    for scheme in SCHEMES:
        rows = run_scheme(s, metrics, layers, a.blocks, scheme, dev)
        total = sum(r["s"] for r in rows)
        out["schemes"][scheme] = {"rows": rows, "sum_s": total, "ratio": total / one_s,
                                  "touched_sum": sum(r["touched"] for r in rows),
                                  "touched_max": max(r["touched"] for r in rows)}
    out["wall_s"] = time.perf_counter() - t_start
    out["load_avg_after"] = os.getloadavg()
    summary(out)
    if a.project_layers:
        out["projection"] = projection(out, a.project_layers, tuple(sorted({a.blocks, 8, 64})))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1, default=str))
    return out


if __name__ == "__main__":
    main()
