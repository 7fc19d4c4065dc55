#!/usr/bin/env python
"""How far each precision setting's scores are from float64's, and whether the discoveries change.

Usage::

    python benchmarks/precision_error.py [--weights results/weights/smollm2-135m/final] [--spaces residual,token,token_norm]

For the model's whole grid (every causal, mirrored and same-layer pair: block 0 of 1) and every
metric x space, ``composition_table.score_space`` at ``float64`` (the reference), ``float32``,
``tf32`` and ``bf16`` (on the CPU the two are emulated by rounding the core products' inputs,
``compatlas.composition.precision``, which is what the GPU's tensor cores compute up to the order of the float32
sums). Per metric x space x comp it prints the largest |score - float64 score| over all pairs in
units of the standard deviation of that cell's null (its anti-causal pairs' float64 scores, the
null the p-values are taken against), and the discoveries (q <= 0.05, ``calibration.calibrate``
with the default null) each precision gains or loses against float64.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import polars as pl  # noqa: E402

from compatlas.composition.calibration import calibrate  # noqa: E402
from compatlas.composition.scores import block_pairs, null_pairs  # noqa: E402
from compatlas.composition.table import score_space  # noqa: E402
from compatlas.models.weights import load_weights  # noqa: E402
from compatlas.vocab import NORMALISED_METRICS as METRICS  # noqa: E402 -- the three the figures were measured for

PRECISIONS = ("float32", "tf32", "bf16")
FDR = 0.05
KEY = ["metric", "space", "comp", "writer_layer", "writer_head", "reader_layer", "reader_head"]


def discoveries(df: pl.DataFrame, kv_group: int) -> pl.DataFrame:
    causal = df.filter(pl.col("writer_layer") < pl.col("reader_layer"))
    null = df.filter(pl.col("writer_layer") >= pl.col("reader_layer"))
    cal = calibrate(causal, null, kv_group=kv_group)
    return cal.filter(pl.col("q_value") <= FDR).select(KEY)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", type=Path, default=ROOT / "results/weights/smollm2-135m/final")
    ap.add_argument("--spaces", default="residual,token,token_norm")
    a = ap.parse_args(argv)
    w = load_weights(a.weights / "weights.safetensors", a.weights / "meta.json")
    layers = list(range(w.n_layers))
    pairs = block_pairs(layers, 1, 0) + null_pairs(layers, 1, 0)
    kv_group = w.n_heads // w.n_kv_heads
    print(f"{w.meta.get('model', a.weights)}: {w.n_layers} layers x {w.n_heads} heads ({w.n_kv_heads} KV), "
          f"d_model {w.d_model}, d_head {w.d_head}; {len(pairs)} layer pairs", flush=True)
    rows, found = [], []
    for space in a.spaces.split(","):
        t0 = time.perf_counter()
        tabs = {dt: pl.concat(score_space(w, METRICS, space, pairs, device="cpu", dtype=dt)[0].values())
                for dt in ("float64", *PRECISIONS)}
        ref = tabs["float64"]
        sd = (ref.filter(pl.col("writer_layer") > pl.col("reader_layer")).group_by("metric", "comp")
              .agg(pl.col("score").std().alias("null_sd")))
        ref_disc = discoveries(ref, kv_group)
        for dt in PRECISIONS:
            err = (tabs[dt].select(*KEY, pl.col("score").alias("s")).join(ref.select(*KEY, "score"), on=KEY)
                   .join(sd, on=["metric", "comp"]).group_by("metric", "comp")
                   .agg(((pl.col("s") - pl.col("score")).abs().max()).alias("max_abs"),
                        ((pl.col("s") - pl.col("score")).abs() / pl.col("null_sd")).max().alias("max_in_null_sd")))
            rows.append(err.with_columns(pl.lit(space).alias("space"), pl.lit(dt).alias("dtype")))
            disc = discoveries(tabs[dt], kv_group)
            for metric in METRICS:
                r, d = (x.filter(pl.col("metric") == metric) for x in (ref_disc, disc))
                found.append({"space": space, "metric": metric, "dtype": dt, "float64": r.height, "this": d.height,
                              "lost": r.join(d, on=KEY, how="anti").height, "gained": d.join(r, on=KEY, how="anti").height})
        print(f"{space}: {time.perf_counter() - t0:.0f} s", flush=True)
    pl.Config.set_tbl_rows(100)
    pl.Config.set_tbl_cols(20)
    err = pl.concat(rows).sort("space", "metric", "comp", "dtype")
    print("\nlargest |score - float64 score| over every pair, and in units of the cell's null standard deviation")
    print(err.pivot(on="dtype", index=["space", "metric", "comp"], values="max_in_null_sd")
          .select("space", "metric", "comp", *PRECISIONS))
    print(err.group_by("dtype").agg(pl.col("max_abs").max(), pl.col("max_in_null_sd").max()).sort("dtype"))
    print(f"\ndiscoveries (q <= {FDR}) against float64's")
    print(pl.DataFrame(found).sort("space", "metric", "dtype"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
