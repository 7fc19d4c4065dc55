"""How well the report's agreement intervals (``compatlas.function.agreement``) are calibrated, and what
they cost.

Coverage: a population of edges with a heavy-tailed function (log-normal |attribution|, spread
``sd``) and a composition score that tracks it noisily; the population's AUROC for its top of the
function and its Spearman, from 400,000 edges; then ``--datasets`` samples of ``--edges`` edges,
each with its 95% bootstrap interval, and the share that covers the population value. Beside it,
the same with the top set fixed as observed (not re-derived per replicate), the usual AUROC
bootstrap, which undercovers when a few edges hold the function.

Cost: one bootstrap of ``--cells`` cells x ``--big`` edges (SmolLM2's Q: 16 x 35,235), per
replicate, against the machine's floor for the same data: one argsort of the cells x edges array
(a bootstrap replicate must at least touch every cell's every edge; the ranks need an order).

    .venv/bin/python benchmarks/agreement_coverage.py [--edges 1000] [--datasets 150]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from compatlas.function import agreement as ag


def population(n: int, sd: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    fn = np.exp(rng.normal(0, sd, n)) * 0.01
    return np.log(fn) + rng.normal(0, 2.0, n), fn


def fixed_top_interval(score: np.ndarray, fn: np.ndarray, n_boot: int, seed: int) -> tuple[float, float]:
    cells, top, rng = ag._Cells.of(score[None]), ag.top_of_function(fn), np.random.default_rng(seed)
    out = []
    for _ in range(n_boot):
        w = np.bincount(rng.integers(0, len(fn), len(fn)), minlength=len(fn)).astype(float)
        out.append(cells.score(w, fn, top & (w > 0))[0][0])
    lo, hi = np.nanquantile(out, [0.025, 0.975])
    return float(lo), float(hi)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--edges", type=int, default=1000)
    ap.add_argument("--datasets", type=int, default=150)
    ap.add_argument("--cells", type=int, default=16)
    ap.add_argument("--big", type=int, default=35_235)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"coverage of 95% intervals, {a.datasets} datasets of {a.edges} edges each")
    print("spread sd | population AUROC | re-derived top: AUROC  Spearman | fixed top: AUROC | mean width AUROC")
    for sd in (1.0, 1.5, 2.5):
        s, f = population(400_000, sd, np.random.default_rng(99))
        truth = ag.bootstrap(s, f, n_boot=0)
        hit = {"auroc": 0, "spearman": 0, "fixed": 0}
        width = 0.0
        for r in range(a.datasets):
            s, f = population(a.edges, sd, rng)
            res = ag.bootstrap(s, f, seed=r)
            for which in ("auroc", "spearman"):
                lo, hi = res.interval(which)
                hit[which] += bool(lo[0] <= getattr(truth, which)[0] <= hi[0])
            lo, hi = res.interval("auroc")
            width += hi[0] - lo[0]
            flo, fhi = fixed_top_interval(s, f, ag.N_BOOT, r)
            hit["fixed"] += bool(flo <= truth.auroc[0] <= fhi)
        n = a.datasets
        print(f"{sd:9.1f} | {truth.auroc[0]:16.3f} | {hit['auroc'] / n:21.2f} {hit['spearman'] / n:9.2f} | "
              f"{hit['fixed'] / n:16.2f} | {width / n:.3f}")
    scores = rng.normal(size=(a.cells, a.big))
    fn = np.exp(rng.normal(0, 1.5, a.big))
    t = time.perf_counter()
    ag.bootstrap(scores, fn, n_boot=20)
    per = (time.perf_counter() - t) / 21
    t = time.perf_counter()
    for _ in range(5):
        np.argsort(scores, axis=1)
    floor = (time.perf_counter() - t) / 5
    print(f"\ncost, {a.cells} cells x {a.big:,} edges: {per * 1e3:.1f} ms per replicate "
          f"({per * ag.N_BOOT:.1f} s for {ag.N_BOOT}); one argsort of the same array {floor * 1e3:.1f} ms; "
          f"ratio {per / floor:.1f}")


if __name__ == "__main__":
    main()
