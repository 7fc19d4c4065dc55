#!/usr/bin/env python
"""Benchmark compatlas' factored composition kernel against the TransformerLens reference.

Usage::

    python benchmarks/bench_composition.py [--quick] [--device cpu|cuda] [--skip-reference]

Parts (each measured in its own child process, one after another, so that each side's
peak RSS is its own and nothing heavy runs beside it):

1. GPT-2-small shapes (12 layers x 12 heads, d_model 768, d_head 64), random Gaussian
   weights with a fixed seed, ``frobenius``, float32. Our kernel (``head_factors`` once,
   then ``layer_pair_scores`` for every writer layer) for Q, K and V against
   ``transformer_lens.utilities.matrix.composition_scores(left, right, broadcast_dims=True)``
   built exactly as ``TransformerBridge.all_composition_scores`` builds it. Reports wall
   time, peak RSS (``ru_maxrss`` after the work) and its increment over the RSS after imports
   and weight creation, the max abs difference of the scores on the upper triangle
   (writer layer < reader layer) and a float64 check on a random subset of layer pairs.
2. One layer pair at Llama-70B shapes (64 query heads, 8 KV heads, d_model 8192,
   d_head 128), all three comps and metrics, float32: ``head_factors`` for 2 layers and
   ``layer_pair_scores`` for the pair, extrapolated to 80 layers / 3160 layer pairs.
3. ``spectrum_baseline`` (n=32) for one layer pair at both shapes.

``--quick`` shrinks everything (4 layers of GPT-2 heads; a 16-head, d_model 2048 stand-in
for part 2) for a smoke test well under 30 s. Results go to stdout and to
``benchmarks/results/composition-<hostname>[-quick].json``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import random
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from compatlas.vocab import COMPS, METRICS  # noqa: E402 -- names only; the timed parts import the kernel themselves

SEED = 0
N_BASELINE = 32  # spectrum_baseline samples
SPEEDUP_TARGET = 20.0
LIMIT_TARGET = 0.75  # frobenius Q+K+V's rate / a plain float32 matmul of its own core shapes, same run
MEMORY_TARGET = 0.1
DIFF_TOL = 1e-5

SHAPES = {
    "gpt2": dict(name="GPT-2-small", n_layers=12, n_heads=12, n_kv_heads=12, d_model=768, d_head=64),
    "gpt2_quick": dict(name="GPT-2 heads, 4 layers (quick)", n_layers=4, n_heads=12, n_kv_heads=12, d_model=768, d_head=64),
    "llama70b": dict(name="Llama-70B", n_layers=80, n_heads=64, n_kv_heads=8, d_model=8192, d_head=128),
    "llama70b_quick": dict(name="GQA stand-in (quick)", n_layers=80, n_heads=8, n_kv_heads=2, d_model=1024, d_head=64),
}


# ----------------------------------------------------------------------------- helpers (children)


def maxrss_mib() -> float:
    """Peak resident set size of this process so far (Linux: ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def rss_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def log(msg: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_weights(shape: dict, n_layers: int, seed: int = SEED):
    """Random Gaussian attention weights (std 0.02, GPT-2's init), float32, on the CPU."""
    import torch

    from compatlas.models.weights import AttentionWeights

    g = torch.Generator(device="cpu").manual_seed(seed)
    H, Hkv, d, dh = shape["n_heads"], shape["n_kv_heads"], shape["d_model"], shape["d_head"]

    def gauss(*s: int):
        return torch.randn(*s, generator=g, dtype=torch.float32) * 0.02

    w = AttentionWeights(
        W_Q=gauss(n_layers, H, d, dh), W_K=gauss(n_layers, Hkv, d, dh),
        W_V=gauss(n_layers, Hkv, d, dh), W_O=gauss(n_layers, H, dh, d),
        W_E=torch.zeros(1, d, dtype=torch.float32),
    )
    w.validate()
    return w


class Timer:
    def __init__(self, device: str):
        self.device = device

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()

    def __call__(self, fn, *a, **kw):
        self.sync()
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        self.sync()
        return time.perf_counter() - t0, out


def time_spectrum_baseline(timer: Timer, f, metric: str, comp: str, l1: int, l2: int, d_model: int,
                           seed: int, repeats: int = 1) -> dict:
    """Time ``spectrum_baseline`` (n = N_BASELINE) for one layer pair, whichever API the kernel has:

    - ``spectrum_baseline(metric, w_norm, w_sv, r_norm, r_sv, P2)`` (P2 drawn once per comp and
      job by ``haar_overlap_blocks(...) ** 2``, then one einsum per layer pair): the draw is
      timed separately (``draw_s``) and is not part of the per-pair cost;
    - ``spectrum_baseline(metric, w_norm, w_sv, r_norm, r_sv, d_model, n, seed)`` (draws inside).
    """
    import inspect

    from compatlas.composition import nulls as C

    args = (f.writer_norm[l1], f.writer_sv[l1], f.reader_norm[comp][l2], f.reader_sv[comp][l2])
    sv = f.writer_sv
    params = inspect.signature(C.spectrum_baseline).parameters
    out: dict = {"api": "P2" if "P2" in params else "d_model, n, seed"}
    if "P2" in params:
        kw = {"device": sv.device} if "device" in inspect.signature(C.haar_overlap_blocks).parameters else {}

        def draw():
            return C.haar_overlap_blocks(d_model, sv.shape[-1], N_BASELINE, seed, **kw).pow(2).to(sv)

        draws = [timer(draw) for _ in range(repeats)]
        out["draw_s"] = statistics.median(t for t, _ in draws)
        P2 = draws[-1][1]
        ts = [timer(C.spectrum_baseline, metric, *args, P2)[0] for _ in range(repeats)]
    else:
        ts = [timer(C.spectrum_baseline, metric, *args, d_model, N_BASELINE, seed)[0] for _ in range(repeats)]
    out["median_s"], out["min_s"] = statistics.median(ts), min(ts)
    return out


def cuda_peak_mib(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.max_memory_allocated() / 2**20


def memory_block(device: str, baseline_maxrss: float, baseline_rss: float) -> dict:
    peak = maxrss_mib()
    return {
        "baseline_rss_mib": baseline_rss,  # VmRSS after imports + weight creation
        "baseline_maxrss_mib": baseline_maxrss,  # ru_maxrss at that point
        "peak_rss_mib": peak,  # ru_maxrss after the work
        "increment_mib": peak - baseline_maxrss,
        "cuda_peak_allocated_mib": cuda_peak_mib(device),
    }


# ----------------------------------------------------------------------------- child: our kernel, GPT-2 shapes


def child_ours(cfg: dict, workdir: Path) -> dict:
    import torch

    from compatlas.composition.scores import head_factors, layer_pair_scores
    from compatlas.runtime import stable_seed

    device, shape, repeats = cfg["device"], SHAPES[cfg["gpt2_shape"]], cfg["repeats"]
    L, H = shape["n_layers"], shape["n_heads"]
    w = make_weights(shape, L).to(device, torch.float32)
    baseline_maxrss, baseline_rss = maxrss_mib(), rss_mib()
    timer = Timer(device)

    def one_comp(comp: str, f=None):
        f = head_factors(w, "frobenius", (comp,)) if f is None else f
        return [layer_pair_scores(f, l1, list(range(l1 + 1, L)), comp) for l1 in range(L - 1)]

    def all_comps():
        f = head_factors(w, "frobenius")
        return {c: one_comp(c, f) for c in COMPS}

    res: dict = {"per_comp": {}}
    scores = {}
    for comp in COMPS:  # cold: the first call of each comp, library initialisation included for Q
        t, out = timer(one_comp, comp)
        full = torch.zeros(L, H, L, H, dtype=torch.float32)
        for l1, s in enumerate(out):  # s: [n_readers, H1, H2] for readers l1+1..L-1
            full[l1, :, l1 + 1:, :] = s.permute(1, 0, 2).cpu()
        scores[comp] = full
        res["per_comp"][comp] = {"cold_s": t}
        log(f"ours {comp}: cold {t:.3f} s")
    for comp in COMPS:
        times = [timer(one_comp, comp)[0] for _ in range(repeats)]
        res["per_comp"][comp].update(median_s=statistics.median(times), min_s=min(times), times_s=times)
        log(f"ours {comp}: median {statistics.median(times):.3f} s over {repeats}")
    times = [timer(all_comps)[0] for _ in range(repeats)]
    res["all_comps_one_head_factors"] = {"median_s": statistics.median(times), "min_s": min(times), "times_s": times}
    res["memory"] = memory_block(device, baseline_maxrss, baseline_rss)
    torch.save(scores, workdir / "ours_scores.pt")

    # spectrum_baseline for one layer pair (0, 1), after the memory reading
    f = head_factors(w, "frobenius")
    res["spectrum_baseline_frobenius"] = {
        comp: time_spectrum_baseline(timer, f, "frobenius", comp, 0, 1, shape["d_model"], stable_seed(SEED, comp, 0, 1), repeats)
        for comp in COMPS}
    res["limit"] = machine_limit(w, timer, repeats)
    return res


def machine_limit(w, timer: Timer, repeats: int) -> dict:
    """The kernel against the machine: each metric's Q+K+V (``head_factors`` once, then
    ``layer_pair_scores`` for every writer layer) against its floor measured in the same
    process, round by round (the rounds interleave, so a burst of load hits both sides):

    - the plain float32 matmuls of the kernel's own core shapes, [H dh, d] @ [d, nR H dh] for
      every writer layer and comp, on fresh contiguous operands (what a perfect kernel would
      cost: the GEMMs and nothing else); also the same FLOPs as 768^3-style square matmuls;
    - for ``svd_bound`` and ``subspace``, that plus the batched small factorisations no
      kernel of theirs can skip: the singular values of the writer's and each comp's reader
      d_head x d_head cores (4 batched ``svdvals`` of [L H, dh, dh]); for ``subspace``, the
      thin QRs of the d_model x d_head factors whose bases it needs (4 batched ``qr``), one
      thread each (the faster way on this machine).

    Rates are GFLOP of the core GEMMs per second, wall and per CPU-second of this process
    (the CPU rate is what other processes' load cannot dilute, the wall rate what a user sees)."""
    import torch

    from compatlas.composition.scores import head_factors, layer_pair_scores

    L, H, d, dh = w.n_layers, w.n_heads, w.d_model, w.d_head
    Hkv = w.n_kv_heads
    g = torch.Generator(device="cpu").manual_seed(SEED)
    E = torch.randn(H * dh, d, generator=g).to(w.W_Q.device)
    # per comp: Q reads per query head (H), K and V per KV head (Hkv) plus each query head's dh x dh post
    widths = {"Q": H, "K": Hkv, "V": Hkv}
    Fs = {c: [torch.randn(d, nR * widths[c] * dh, generator=g).to(E.device) for nR in range(1, L)] for c in COMPS}
    Ps = {c: torch.randn(Hkv, dh, H // Hkv * dh, generator=g).to(E.device) for c in COMPS if widths[c] != H}
    flops = sum(2 * E.shape[0] * d * F.shape[1] for c in COMPS for F in Fs[c])
    flops += sum(2 * H * E.shape[0] * dh * dh * nR for c in Ps for nR in range(1, L))
    sq = torch.randn(768, 768, generator=g).to(E.device)
    n_square = max(1, round(flops / (2 * 768**3)))

    def gemms():
        for c in COMPS:
            for F in Fs[c]:
                core = E @ F
                if c in Ps:  # grouped K/V: each query head's dh x dh product
                    nR = F.shape[1] // (widths[c] * dh)
                    core.view(E.shape[0], nR * widths[c], dh).transpose(0, 1) @ Ps[c].repeat(nR, 1, 1)

    def square():
        for _ in range(n_square):
            sq @ sq

    def one_thread(fn):
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            fn()
        finally:
            torch.set_num_threads(n)

    cores = torch.randn(L * H, dh, dh, generator=g).to(E.device)
    tall = torch.randn(L * H, d, dh, generator=g).to(E.device)
    small = {"svd_bound": lambda: one_thread(lambda: [torch.linalg.svdvals(cores) for _ in range(4)]),
             "subspace": lambda: one_thread(lambda: [(torch.linalg.qr(tall), torch.linalg.svdvals(cores)) for _ in range(4)])}

    def kernel(metric):
        def run():
            f = head_factors(w, metric)
            for c in COMPS:
                for l1 in range(L - 1):
                    layer_pair_scores(f, l1, list(range(l1 + 1, L)), c)
        return run

    parts = {"matmul_core_shapes": gemms, "matmul_768_cubed": square, **{f"small_{m}": fn for m, fn in small.items()},
             **{f"kernel_{m}": kernel(m) for m in METRICS}}
    for fn in parts.values():  # warm-up
        fn()
    wall: dict = {k: [] for k in parts}
    cpu: dict = {k: [] for k in parts}
    for _ in range(max(repeats, 5)):
        for k, fn in parts.items():
            c0 = time.process_time()
            wall[k].append(timer(fn)[0])
            cpu[k].append(time.process_time() - c0)
    med = lambda xs: statistics.median(xs)  # noqa: E731
    out: dict = {"gflop": flops / 1e9, "n_square_768": n_square, "rounds": len(wall["kernel_frobenius"]),
                 "wall_s": {k: med(v) for k, v in wall.items()}, "cpu_s": {k: med(v) for k, v in cpu.items()},
                 "times_s": wall, "cpu_times_s": cpu}
    for m in METRICS:
        floor_w = [a + (wall[f"small_{m}"][i] if m != "frobenius" else 0.0) for i, a in enumerate(wall["matmul_core_shapes"])]
        floor_c = [a + (cpu[f"small_{m}"][i] if m != "frobenius" else 0.0) for i, a in enumerate(cpu["matmul_core_shapes"])]
        out[m] = {
            "kernel_gflops": flops / 1e9 / med(wall[f"kernel_{m}"]),
            "floor_s": med(floor_w),
            # per round: floor / kernel (= kernel rate / floor rate), then the median over rounds
            "fraction_of_floor_wall": med([f / k for f, k in zip(floor_w, wall[f"kernel_{m}"])]),
            "fraction_of_floor_cpu": med([f / k for f, k in zip(floor_c, cpu[f"kernel_{m}"])]),
        }
    out["matmul_core_gflops"] = flops / 1e9 / med(wall["matmul_core_shapes"])
    out["matmul_768_gflops"] = n_square * 2 * 768**3 / 1e9 / med(wall["matmul_768_cubed"])
    out["pass"] = out["frobenius"]["fraction_of_floor_wall"] >= LIMIT_TARGET
    log(f"limit: frobenius Q+K+V {out['frobenius']['kernel_gflops']:.0f} GFLOP/s, matmul of its core shapes "
        f"{out['matmul_core_gflops']:.0f} GFLOP/s: {out['frobenius']['fraction_of_floor_wall']:.0%}")
    return out


# ----------------------------------------------------------------------------- child: TransformerLens reference


def child_reference(cfg: dict, workdir: Path) -> dict:
    import torch
    from transformer_lens import FactoredMatrix
    from transformer_lens.utilities.matrix import composition_scores

    device, shape = cfg["device"], SHAPES[cfg["gpt2_shape"]]
    L = shape["n_layers"]
    w = make_weights(shape, L).to(device, torch.float32)
    W_K, W_V = w.expanded_kv()  # what TransformerBridge._expand_kv_heads does (a no-op for GPT-2)
    W_Q, W_O = w.W_Q, w.W_O
    baseline_maxrss, baseline_rss = maxrss_mib(), rss_mib()
    timer = Timer(device)

    def reference(comp: str):
        # TransformerBridge.all_composition_scores, transformer_lens 4.x
        left = FactoredMatrix(W_V, W_O)
        if comp == "Q":
            right = FactoredMatrix(W_Q, W_K.transpose(-2, -1))
        elif comp == "K":
            right = FactoredMatrix(W_Q, W_K.transpose(-2, -1)).T
        else:
            right = left
        return composition_scores(left, right, broadcast_dims=True)  # [L, H, L, H]

    res: dict = {"per_comp": {}}
    scores = {}
    for comp in COMPS:  # sequentially, one at a time
        t, s = timer(reference, comp)
        scores[comp] = s.detach().cpu().clone()
        del s
        gc.collect()
        res["per_comp"][comp] = {"time_s": t, "maxrss_after_mib": maxrss_mib()}
        log(f"reference {comp}: {t:.1f} s, ru_maxrss so far {maxrss_mib() / 1024:.2f} GiB")
    res["memory"] = memory_block(device, baseline_maxrss, baseline_rss)
    torch.save(scores, workdir / "reference_scores.pt")

    # float64 check on a random subset of layer pairs (after the memory reading)
    res["float64_check"] = float64_check(w, scores, workdir, FactoredMatrix, composition_scores)
    return res


def float64_check(w32, ref32: dict, workdir: Path, FactoredMatrix, composition_scores) -> dict:
    """Ours vs reference, both in float64, on a random subset of (writer, reader) layer pairs;
    plus how far each float32 side is from the float64 reference on that subset."""
    import torch

    from compatlas.composition.scores import head_factors, layer_pair_scores, layer_pairs

    w = w32.to("cpu", torch.float64)
    W_K, W_V = w.expanded_kv()
    pairs = layer_pairs(list(range(w.n_layers)))
    subset = sorted(random.Random(SEED).sample(pairs, min(6, len(pairs))))
    ours32_path = workdir / "ours_scores.pt"
    ours32 = torch.load(ours32_path) if ours32_path.exists() else None
    out = {"layer_pairs": subset, "n_head_pairs": 0}
    for comp in COMPS:
        f = head_factors(w, "frobenius", (comp,))
        d64 = d_ours32 = d_ref32 = 0.0
        for l1, l2 in subset:
            left = FactoredMatrix(W_V[l1], w.W_O[l1])
            if comp == "Q":
                right = FactoredMatrix(w.W_Q[l2], W_K[l2].transpose(-2, -1))
            elif comp == "K":
                right = FactoredMatrix(w.W_Q[l2], W_K[l2].transpose(-2, -1)).T
            else:
                right = FactoredMatrix(W_V[l2], w.W_O[l2])
            ref64 = composition_scores(left, right, broadcast_dims=True)  # [H1, H2]
            ours64 = layer_pair_scores(f, l1, [l2], comp)[0]
            d64 = max(d64, (ours64 - ref64).abs().max().item())
            d_ref32 = max(d_ref32, (ref32[comp][l1, :, l2, :].double() - ref64).abs().max().item())
            if ours32 is not None:
                d_ours32 = max(d_ours32, (ours32[comp][l1, :, l2, :].double() - ref64).abs().max().item())
            if comp == "Q":
                out["n_head_pairs"] += ref64.numel()
        out[comp] = {"ours64_vs_ref64": d64, "ref32_vs_ref64": d_ref32,
                     "ours32_vs_ref64": d_ours32 if ours32 is not None else None}
    return out


# ----------------------------------------------------------------------------- child: one layer pair at Llama-70B shapes


def child_big(cfg: dict, workdir: Path) -> dict:
    import torch

    from compatlas.composition.scores import head_factors, layer_pair_scores
    from compatlas.runtime import stable_seed

    device, shape = cfg["device"], SHAPES[cfg["big_shape"]]
    timer = Timer(device)
    # warm-up at a small shape, so that library initialisation is not timed
    small = make_weights(SHAPES["gpt2_quick"], 2).to(device, torch.float32)
    for metric in METRICS:
        layer_pair_scores(head_factors(small, metric), 0, [1], "Q")
    del small

    t0 = time.perf_counter()
    w = make_weights(shape, 2).to(device, torch.float32)
    gen_s = time.perf_counter() - t0
    log(f"{shape['name']}: 2 layers of random weights in {gen_s:.1f} s")
    baseline_maxrss, baseline_rss = maxrss_mib(), rss_mib()

    L = shape["n_layers"]
    n_pairs = L * (L - 1) // 2
    res: dict = {"weights_gen_s": gen_s, "n_layers_extrapolated": L, "n_layer_pairs_extrapolated": n_pairs, "metrics": {}}
    for metric in METRICS:
        t_hf, f = timer(head_factors, w, metric)  # all three comps at once, as the pipeline does
        log(f"{metric}: head_factors (2 layers, Q/K/V) {t_hf:.2f} s")
        pair, sb, sb_detail = {}, {}, {}
        for comp in COMPS:
            pair[comp], _ = timer(layer_pair_scores, f, 0, [1], comp)
            sb_detail[comp] = time_spectrum_baseline(timer, f, metric, comp, 0, 1, shape["d_model"],
                                                     stable_seed(SEED, metric, comp, 0, 1), repeats=3)
            sb[comp] = sb_detail[comp]["median_s"]
            draw = sb_detail[comp].get("draw_s")
            log(f"{metric} {comp}: layer pair {pair[comp]:.2f} s, spectrum_baseline {sb[comp] * 1e3:.1f} ms"
                + (f" (+ P2 draw once per job {draw * 1e3:.0f} ms)" if draw is not None else ""))
        del f
        gc.collect()
        est_hf = t_hf / 2 * L
        est_pairs = sum(pair.values()) * n_pairs
        est_sb = sum(sb.values()) * n_pairs  # per layer pair; a P2 draw (if any) is once per job: not included
        res["metrics"][metric] = {
            "head_factors_2_layers_s": t_hf, "layer_pair_s": pair, "spectrum_baseline_s": sb,
            "spectrum_baseline_detail": sb_detail,
            "estimate_s": {"head_factors": est_hf, "pair_scores": est_pairs, "kernel_total": est_hf + est_pairs,
                           "spectrum_baselines": est_sb, "total_with_baselines": est_hf + est_pairs + est_sb},
        }
    res["memory"] = memory_block(device, baseline_maxrss, baseline_rss)
    return res


CHILDREN = {"ours": child_ours, "reference": child_reference, "big": child_big}


def cpu_busy_s() -> float:
    """CPU seconds spent busy by the whole machine since boot, all cores (/proc/stat)."""
    with open("/proc/stat") as fh:
        f = [int(x) for x in fh.readline().split()[1:]]
    busy = f[0] + f[1] + f[2] + f[5] + f[6] + (f[7] if len(f) > 7 else 0)  # user nice system irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def wait_for_idle(timeout_s: float, threshold: float = 0.25, window_s: float = 2.0) -> float:
    """Wait (up to timeout_s) until the machine's CPUs are < threshold busy over a window;
    return the busy fraction last seen. Other people's jobs cannot be stopped, only waited out."""
    deadline = time.monotonic() + timeout_s
    window_s = window_s if timeout_s > 0 else 0.5
    while True:
        b0 = cpu_busy_s()
        time.sleep(window_s)
        frac = (cpu_busy_s() - b0) / (window_s * (os.cpu_count() or 1))
        if frac < threshold or time.monotonic() >= deadline:
            if frac >= threshold:
                print(f"!! machine still {frac:.0%} busy with other work after waiting {timeout_s:.0f} s; "
                      "timings will be contaminated (see foreign_cpu_s in the JSON)", file=sys.stderr, flush=True)
            return frac


def run_child(role: str, cfg: dict, workdir: Path) -> dict | None:
    """Run one part in a fresh interpreter (same script, hidden flag); wait for it to finish.

    Records how many CPU seconds other processes used while it ran (foreign_cpu_s): the
    machine's busy time minus the child's own, as a check that nothing else ran beside it."""
    idle_before = wait_for_idle(cfg["idle_timeout_s"])
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_child", role, "--_workdir", str(workdir),
           "--_config", json.dumps(cfg)]
    b0, c0, t0 = cpu_busy_s(), children_cpu_s(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=str(ROOT))
    wall = time.perf_counter() - t0
    foreign = max(0.0, (cpu_busy_s() - b0) - (children_cpu_s() - c0))
    out = workdir / f"{role}.json"
    if proc.returncode != 0 or not out.exists():
        print(f"!! child {role!r} failed with exit code {proc.returncode}", file=sys.stderr)
        return None
    res = json.loads(out.read_text())
    res["child_wall_s"] = wall
    res["busy_fraction_before"] = idle_before
    res["foreign_cpu_s"] = foreign
    res["foreign_cpu_fraction"] = foreign / (wall * (os.cpu_count() or 1))
    if res["foreign_cpu_fraction"] > 0.05:
        print(f"!! other processes used {foreign:.0f} CPU-s ({res['foreign_cpu_fraction']:.0%} of the machine) "
              f"while {role!r} ran", file=sys.stderr, flush=True)
    return res


# ----------------------------------------------------------------------------- parent: compare, report


def compare_scores(workdir: Path) -> dict:
    import torch

    ours = torch.load(workdir / "ours_scores.pt")
    ref = torch.load(workdir / "reference_scores.pt")
    out = {}
    for comp in COMPS:
        L = ours[comp].shape[0]
        mask = torch.arange(L)[:, None] < torch.arange(L)[None, :]  # writer layer < reader layer
        o = ours[comp].permute(0, 2, 1, 3)[mask]  # [n_layer_pairs, H1, H2]
        r = ref[comp].permute(0, 2, 1, 3)[mask]
        diff = (o - r).abs()
        out[comp] = {"max_abs_diff": diff.max().item(), "max_rel_diff": (diff / r.abs().clamp_min(1e-12)).max().item(),
                     "n_head_pairs": o.numel(), "score_mean": r.mean().item(), "score_max": r.max().item()}
    return out


def fmt_mib(x: float | None) -> str:
    return "-" if x is None else (f"{x / 1024:.2f} GiB" if x >= 1024 else f"{x:.0f} MiB")


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def report(results: dict) -> None:
    env, p1 = results["environment"], results["gpt2"]
    ours, ref = p1.get("ours"), p1.get("reference")
    print()
    print(f"compatlas composition benchmark  {env['date']}  host {env['hostname']}  device {env['device']}")
    print(f"  {env['cpu']} x {env['cpu_count']} cores, torch {env['torch']} ({env['torch_threads']} threads), "
          f"transformer_lens {env['transformer_lens']}, compatlas/composition/scores.py sha256 {env['kernel_sha256'][:12]}")
    if not (ours or ref):
        print("\n[1] skipped")
    else:
        s = p1["shape"]
        print(f"\n[1] {s['name']}: {s['n_layers']} layers x {s['n_heads']} heads, d_model {s['d_model']}, d_head {s['d_head']}; "
              "frobenius, float32, random Gaussian weights (seed 0)")
        print(f"    {'comp':<6}{'ours median':>13}{'ours cold':>11}{'reference':>11}{'speedup':>10}{'max|diff|':>12}")
        for comp in COMPS:
            o = ours["per_comp"][comp] if ours else None
            r = ref["per_comp"][comp]["time_s"] if ref else None
            sp = f"{r / o['median_s']:.0f}x" if (o and r) else "-"
            dd = p1.get("agreement", {}).get(comp, {}).get("max_abs_diff")
            om = f"{o['median_s']:.3f} s" if o else "-"
            oc = f"{o['cold_s']:.3f} s" if o else "-"
            rs = f"{r:.1f} s" if r else "-"
            ds = f"{dd:.1e}" if dd is not None else "-"
            print(f"    {comp:<6}{om:>13}{oc:>11}{rs:>11}{sp:>10}{ds:>12}")
        if ours:
            rs = f"{ref['total_s']:.1f} s" if ref else "-"
            sp = f"{p1['ratios']['speedup']:.0f}x" if ref else "-"
            print(f"    {'Q+K+V':<6}{ours['sum_median_s']:>11.3f} s{ours['sum_cold_s']:>9.3f} s{rs:>11}{sp:>10}")
            print(f"    (ours, all three comps sharing one head_factors call: "
                  f"{ours['all_comps_one_head_factors']['median_s']:.3f} s median)")
        print(f"\n    {'peak RSS':<12}{'peak':>11}{'baseline':>11}{'increment':>11}")
        for name, side in (("ours", ours), ("reference", ref)):
            if side:
                m = side["memory"]
                print(f"    {name:<12}{fmt_mib(m['peak_rss_mib']):>11}{fmt_mib(m['baseline_maxrss_mib']):>11}"
                      f"{fmt_mib(m['increment_mib']):>11}")
        if ours and ref:
            r = p1["ratios"]
            print(f"\n    speedup (ref / ours, median)   {r['speedup']:8.1f}x   target >= {SPEEDUP_TARGET:.0f}x   "
                  f"{verdict(r['speedup_pass'])}")
            print(f"    speedup (ref / ours, cold)     {r['speedup_cold']:8.1f}x")
            print(f"    memory (ours / ref peak RSS)   {r['memory_ratio']:8.4f}    target <= {MEMORY_TARGET}   {verdict(r['memory_pass'])}")
            print(f"    memory (increments ours / ref) {r['memory_increment_ratio']:8.4f}")
            a = p1["agreement"]
            print(f"    max |ours - ref| float32, upper triangle ({a['Q']['n_head_pairs']} head pairs per comp): "
                  f"{r['max_abs_diff']:.2e}   tol {DIFF_TOL:g}   {verdict(r['agreement_pass'])}")
            c = ref.get("float64_check")
            if c:
                worst = lambda k: max(c[x][k] or 0.0 for x in COMPS)  # noqa: E731
                print(f"    float64 check on {len(c['layer_pairs'])} random layer pairs {c['layer_pairs']}: "
                      f"|ours64 - ref64| <= {worst('ours64_vs_ref64'):.1e}; float32 error vs ref64: "
                      f"ours {worst('ours32_vs_ref64'):.1e}, reference {worst('ref32_vs_ref64'):.1e}")
            if env["quick"]:
                print("    (--quick: shapes too small for the speed and memory targets to mean anything)")
        elif not ref:
            print("    (reference skipped)")
        for name, side in (("ours", ours), ("reference", ref)):
            if side and side.get("foreign_cpu_fraction", 0) > 0.05:
                print(f"    WARNING: other processes used {side['foreign_cpu_s']:.0f} CPU-s "
                      f"({side['foreign_cpu_fraction']:.0%} of the machine) while {name} ran")
        lim = ours.get("limit") if ours else None
        if lim:
            print(f"\n    the kernel against the machine (same process, {lim['rounds']} interleaved rounds, medians; "
                  f"{lim['gflop']:.0f} GFLOP of core GEMMs for Q+K+V):")
            print(f"    plain float32 matmul of the kernel's core shapes {lim['matmul_core_gflops']:6.0f} GFLOP/s "
                  f"({lim['wall_s']['matmul_core_shapes']:.3f} s); square 768^3 matmuls {lim['matmul_768_gflops']:.0f} GFLOP/s")
            print(f"    {'metric':<11}{'kernel':>9}{'GFLOP/s':>9}{'floor':>9}{'of floor (wall)':>17}{'(CPU time)':>12}   floor")
            for m in METRICS:
                x = lim[m]
                what = "core GEMMs" if m == "frobenius" else ("+ 4 batched svdvals" if m == "svd_bound" else "+ 4 batched qr + svdvals")
                print(f"    {m:<11}{lim['wall_s']['kernel_' + m]:>7.3f} s{x['kernel_gflops']:>9.0f}{x['floor_s']:>7.3f} s"
                      f"{x['fraction_of_floor_wall']:>16.0%}{x['fraction_of_floor_cpu']:>12.0%}   {what}")
            print(f"    frobenius Q+K+V at {lim['frobenius']['fraction_of_floor_wall']:.0%} of the same-run matmul rate   "
                  f"target >= {LIMIT_TARGET:.0%}   {verdict(lim['pass'])}")
            if ref:
                print(f"    (beside the TransformerLens ratio above: {p1['ratios']['speedup']:.1f}x)")
        if ours:
            sb = ours["spectrum_baseline_frobenius"]
            print(f"    spectrum_baseline, one layer pair, n={N_BASELINE}, frobenius: "
                  + ", ".join(f"{c} {sb[c]['median_s'] * 1e3:.2f} ms" for c in COMPS)
                  + (" (+ P2 draw, once per comp and job: " + ", ".join(f"{c} {sb[c]['draw_s'] * 1e3:.1f} ms" for c in COMPS) + ")"
                     if "draw_s" in sb["Q"] else ""))

    big = results.get("big")
    if big:
        s = big["shape"]
        print(f"\n[2] {s['name']}: one layer pair, {s['n_heads']} query / {s['n_kv_heads']} KV heads, d_model {s['d_model']}, "
              f"d_head {s['d_head']}, float32, {env['device']}; extrapolated to {s['n_layers']} layers "
              f"({big['n_layers_extrapolated'] * (big['n_layers_extrapolated'] - 1) // 2} layer pairs)")
        print(f"    {'metric':<11}{'hf 2 layers':>12}{'pair Q':>9}{'pair K':>9}{'pair V':>9}{'sb Q+K+V':>10}"
              f"{'est. hf':>10}{'est. pairs':>12}{'est. kernel':>13}{'+ baselines':>13}")
        tot = 0.0
        for metric, m in big["metrics"].items():
            e = m["estimate_s"]
            tot += e["total_with_baselines"]
            print(f"    {metric:<11}{m['head_factors_2_layers_s']:>10.2f} s"
                  + "".join(f"{m['layer_pair_s'][c]:>7.2f} s" for c in COMPS)
                  + f"{sum(m['spectrum_baseline_s'].values()) * 1e3:>7.1f} ms"
                  + f"{e['head_factors'] / 3600:>8.2f} h{e['pair_scores'] / 3600:>10.2f} h"
                  + f"{e['kernel_total'] / 3600:>11.2f} h{e['total_with_baselines'] / 3600:>11.2f} h")
        print(f"    all three metrics, Q/K/V, with spectrum baselines: {tot / 3600:.2f} h on this device")
        draws = [m["spectrum_baseline_detail"][c].get("draw_s") for m in big["metrics"].values() for c in COMPS]
        if all(d is not None for d in draws):
            print(f"    (P2 draws for the spectrum baseline, once per comp and job, not in the estimate: "
                  f"{min(draws) * 1e3:.0f}-{max(draws) * 1e3:.0f} ms each)")
        if big.get("foreign_cpu_fraction", 0) > 0.05:
            print(f"    WARNING: other processes used {big['foreign_cpu_s']:.0f} CPU-s "
                  f"({big['foreign_cpu_fraction']:.0%} of the machine) while this part ran")
        print(f"    peak RSS of this part: {fmt_mib(big['memory']['peak_rss_mib'])} "
              f"(baseline {fmt_mib(big['memory']['baseline_maxrss_mib'])})"
              + (f", CUDA peak allocated {fmt_mib(big['memory']['cuda_peak_allocated_mib'])}"
                 if big["memory"]["cuda_peak_allocated_mib"] is not None else ""))


def kernel_sha256() -> str:
    import hashlib

    return hashlib.sha256((ROOT / "compatlas" / "composition.py").read_bytes()).hexdigest()


def environment(device: str, quick: bool) -> dict:
    import importlib.metadata as md

    import numpy
    import torch

    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(l.split(":", 1)[1].strip() for l in fh if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        tl = md.version("transformer_lens")
    except md.PackageNotFoundError:
        tl = None
    return {
        "kernel_sha256": kernel_sha256(),  # which version of compatlas/composition/scores.py was timed
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "hostname": socket.gethostname(), "device": device, "quick": quick,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "cpu": cpu, "cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "cuda_device": torch.cuda.get_device_name() if device.startswith("cuda") else None,
        "numpy": numpy.__version__, "transformer_lens": tl, "python": platform.python_version(),
        "mem_total_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small shapes, a smoke test (< 30 s)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    ap.add_argument("--skip-reference", action="store_true", help="do not run the TransformerLens reference")
    ap.add_argument("--skip-big", action="store_true", help="do not run part 2 (Llama-70B shapes)")
    ap.add_argument("--skip-gpt2", action="store_true", help="do not run part 1 (GPT-2 shapes, ours and reference)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats of our kernel, median reported (5; quick: 3)")
    ap.add_argument("--idle-timeout", type=float, default=None,
                    help="seconds to wait for other CPU load to go away before each part (300; quick: 0)")
    ap.add_argument("--json", type=Path, default=None, help="where to write the results JSON")
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    ap.add_argument("--_workdir", help=argparse.SUPPRESS)
    ap.add_argument("--_config", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args._child:  # a measured part, in its own process
        workdir = Path(args._workdir)
        sha = kernel_sha256()
        res = CHILDREN[args._child](json.loads(args._config), workdir)
        res["kernel_sha256"] = sha
        (workdir / f"{args._child}.json").write_text(json.dumps(res))
        return 0

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no CUDA device")
    cfg = {"device": device, "repeats": args.repeats or (3 if args.quick else 5),
           "idle_timeout_s": args.idle_timeout if args.idle_timeout is not None else (0.0 if args.quick else 300.0),
           "gpt2_shape": "gpt2_quick" if args.quick else "gpt2",
           "big_shape": "llama70b_quick" if args.quick else "llama70b"}
    results: dict = {"environment": environment(device, args.quick),
                     "targets": {"speedup_min": SPEEDUP_TARGET, "memory_ratio_max": MEMORY_TARGET, "max_abs_diff": DIFF_TOL},
                     "gpt2": {"shape": SHAPES[cfg["gpt2_shape"]]}}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_composition_") as tmp:
        workdir = Path(tmp)
        ours = ref = None
        if not args.skip_gpt2:
            print(f"[1] our kernel, {SHAPES[cfg['gpt2_shape']]['name']} ...", file=sys.stderr, flush=True)
            ours = run_child("ours", cfg, workdir)
        if not (args.skip_reference or args.skip_gpt2):
            print("[1] TransformerLens reference (sequential Q, K, V; the heavy part) ...", file=sys.stderr, flush=True)
            ref = run_child("reference", cfg, workdir)
        p1 = results["gpt2"]
        if ours:
            pc = ours["per_comp"]
            ours["sum_median_s"] = sum(pc[c]["median_s"] for c in pc)
            ours["sum_cold_s"] = sum(pc[c]["cold_s"] for c in pc)
            p1["ours"] = ours
        if ref:
            ref["total_s"] = sum(v["time_s"] for v in ref["per_comp"].values())
            p1["reference"] = ref
        if ours and ref:
            p1["agreement"] = agr = compare_scores(workdir)
            max_diff = max(a["max_abs_diff"] for a in agr.values())
            speedup = ref["total_s"] / ours["sum_median_s"]
            mem = ours["memory"]["peak_rss_mib"] / ref["memory"]["peak_rss_mib"]
            p1["ratios"] = {
                "speedup": speedup, "speedup_cold": ref["total_s"] / ours["sum_cold_s"],
                "speedup_per_comp": {c: ref["per_comp"][c]["time_s"] / ours["per_comp"][c]["median_s"] for c in COMPS},
                "memory_ratio": mem,
                "memory_increment_ratio": ours["memory"]["increment_mib"] / ref["memory"]["increment_mib"],
                "max_abs_diff": max_diff,
                "speedup_pass": speedup >= SPEEDUP_TARGET, "memory_pass": mem <= MEMORY_TARGET,
                "agreement_pass": max_diff < DIFF_TOL,
            }
        if not args.skip_big:
            print(f"[2] one layer pair at {SHAPES[cfg['big_shape']]['name']} shapes ...", file=sys.stderr, flush=True)
            big = run_child("big", cfg, workdir)
            if big:
                big["shape"] = SHAPES[cfg["big_shape"]]
                results["big"] = big
    results["total_wall_s"] = time.perf_counter() - t_start
    shas = {results["environment"]["kernel_sha256"], kernel_sha256()} | {
        r.get("kernel_sha256") for r in (results["gpt2"].get("ours"), results["gpt2"].get("reference"), results.get("big")) if r}
    results["kernel_changed_during_run"] = len(shas - {None}) > 1
    if results["kernel_changed_during_run"]:
        print("!! compatlas/composition/scores.py changed while the benchmark ran: parts timed different versions", file=sys.stderr)

    report(results)
    out = args.json or ROOT / "benchmarks" / "results" / (
        f"composition-{socket.gethostname()}{'-quick' if args.quick else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str))
    print(f"\nresults written to {out} (total {results['total_wall_s']:.0f} s)")
    # exit status: 1 if a part failed or the scores disagree; speed / memory targets count
    # only at full size (at --quick shapes the fixed interpreter + torch RSS dominates)
    checks = ("agreement_pass",) if args.quick else ("speedup_pass", "memory_pass", "agreement_pass")
    failed = [k for k in checks if not results["gpt2"].get("ratios", {}).get(k, True)]
    lim = (results["gpt2"].get("ours") or {}).get("limit")
    failed += ["limit"] if lim and not lim["pass"] and not args.quick else []
    failed += [k for k in ("ours", "reference") if k not in results["gpt2"] and not args.skip_gpt2
               and not (k == "reference" and args.skip_reference)]
    failed += [] if args.skip_big or "big" in results else ["big"]
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
