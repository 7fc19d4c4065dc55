"""The induction job's forward passes (strength sweep, head scores, exact ablation) by device and
precision: CPU float32 (the reference, measured in the same run) against GPU float32, bfloat16
and float16, with how far each one's numbers move from float32.

    python benchmarks/bench_behaviour_device.py [--shapes smollm2,gpt2-small] [--gpu-only llama-1b]
                                                [--trained induction-2l] [--tokens N] [--sequences N]
                                                [--ablation-sequences N] [--json out.json]

Each model runs ``induction.measure_behaviour`` (what the ``induction`` rule runs, with the
default config's ``induction`` settings) once per (device, dtype). Models: the trained 2-layer
model of ``config/config.yaml`` (trained in the run, about 15 s; its induction heads are real,
so its float32-vs-half agreement is the meaningful one) and randomly initialised models built
from a shape (``SHAPES``; the timing is the shape's, the weights' values do not change it).
``--gpu-only`` shapes skip the CPU reference (too slow there) and also boot with
``device_map: auto`` to check that placement gives the same numbers.

Agreement, against float32 on the same device: the largest difference in a token's mean
strength (log-odds, ``induction_tokens.mean``) and in a head's ablation drop, over the
measured tokens / heads, and the Spearman correlation of the drops over heads.
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

import polars as pl
import torch
import yaml
from bench_ablation import spearman, train_run

from compatlas.behaviour.induction import DTYPES, measure_behaviour, token_directions
from compatlas.models.loading import boot
from compatlas.plan.config import validate_config

REPO = Path(__file__).resolve().parent.parent
log = logging.getLogger("bench_behaviour_device")

# Built (random) models with the attention and vocabulary shapes of real ones. d_mlp is the
# builder's 4 x d_model (SmolLM2's is 1536, Llama-3.2-1B's 8192): a little more MLP work.
SHAPES: dict[str, dict] = {
    "smollm2": {"architecture": "llama", "n_layers": 30, "n_heads": 9, "n_kv_heads": 3, "d_head": 64,
                "d_vocab": 49152, "tie_embeddings": True},
    "gpt2-small": {"architecture": "gpt2", "n_layers": 12, "n_heads": 12, "d_head": 64, "d_vocab": 50257},
    "llama-1b": {"architecture": "llama", "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "d_head": 64,
                 "d_vocab": 128256},
}


def run_once(entry: dict, workdir: Path, settings: dict, device: str, dtype: str,
             device_map: str | None = None) -> tuple[dict, pl.DataFrame, pl.DataFrame]:
    """Boot the model on ``device`` in ``dtype`` and time ``measure_behaviour`` on it."""
    cuda = device.startswith("cuda")
    t0 = time.perf_counter()
    model, _ = boot(entry, None, workdir, device, dtype=DTYPES[dtype], device_map=device_map)
    model.eval()
    t_boot = time.perf_counter() - t0
    with torch.no_grad():
        W_E, W_U = model.W_E.detach().float().cpu(), model.W_U.detach().float().cpu()
    directions = token_directions(W_E, W_U)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    tokens, heads, _ = measure_behaviour(model, model.tokenizer, directions, settings, W_E)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    row = {"device": device, "dtype": dtype, "device_map": device_map, "boot_s": round(t_boot, 2),
           "measure_s": round(seconds, 2)}
    del model
    if cuda:
        row["cuda_peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        torch.cuda.empty_cache()
    return row, tokens, heads


def agreement(ref: tuple[pl.DataFrame, pl.DataFrame], other: tuple[pl.DataFrame, pl.DataFrame]) -> dict:
    """How far ``other``'s strengths and drops are from ``ref``'s (same tokens, same heads)."""
    keys = ["filler_before", "filler_between", "token_id", "role"]
    t = ref[0].join(other[0], on=keys, suffix="_o")
    h = ref[1].join(other[1], on=["layer", "head"], suffix="_o")
    return {"max_abs_strength_diff": round(float((t["mean"] - t["mean_o"]).abs().max()), 4),
            "max_strength_stderr": round(float(t["stderr"].max()), 4),
            "max_abs_drop_diff": round(float((h["ablation_drop"] - h["ablation_drop_o"]).abs().max()), 4),
            "drop_spearman": round(spearman(h["ablation_drop"], h["ablation_drop_o"]), 4),
            "max_abs_induction_score_diff": round(float((h["induction_mean"] - h["induction_mean_o"]).abs().max()), 4)}


def bench_model(name: str, entry: dict, workdir: Path, settings: dict, cpu: bool, gpu: bool,
                check_device_map: bool) -> dict:
    out: dict = {"runs": []}
    results: dict[tuple, tuple] = {}
    plan = ([("cpu", "float32", None)] if cpu else []) + (
        [("cuda", d, None) for d in ("float32", "bfloat16", "float16")] if gpu else []) + (
        [("cuda", "bfloat16", "auto")] if gpu and check_device_map else [])
    for device, dtype, device_map in plan:
        log.info("%s: %s %s%s", name, device, dtype, f" device_map={device_map}" if device_map else "")
        row, tokens, heads = run_once(entry, workdir, settings, device, dtype, device_map)
        results[(device, dtype, device_map)] = (tokens, heads)
        out["runs"].append(row)
        log.info("%s", row)
    times = {(r["device"], r["dtype"], r["device_map"]): r["measure_s"] for r in out["runs"]}
    ref_key = ("cpu", "float32", None) if cpu else ("cuda", "float32", None)
    for key, res in results.items():
        if key == ref_key:
            continue
        label = f"{key[0]}_{key[1]}" + (f"_map_{key[2]}" if key[2] else "")
        out[label] = {"speedup_vs_" + "_".join(ref_key[:2]): round(times[ref_key] / times[key], 2),
                      **agreement(results[ref_key], res)}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="smollm2,gpt2-small", help=f"built shapes with a CPU reference: {sorted(SHAPES)}")
    p.add_argument("--gpu-only", default="llama-1b", help="built shapes measured on the GPU only")
    p.add_argument("--trained", default="induction-2l", help="a training run of config/config.yaml ('' to skip)")
    p.add_argument("--tokens", type=int, default=None, help="induction.tokens (default: the config's)")
    p.add_argument("--sequences", type=int, default=None, help="induction.sequences (default: the config's)")
    p.add_argument("--ablation-sequences", type=int, default=None, help="induction.ablation.sequences")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    gpu = torch.cuda.is_available()
    if not gpu:
        log.warning("no CUDA device: only the CPU float32 runs are measured")

    config = validate_config(yaml.safe_load((REPO / "config" / "config.yaml").read_text()))
    settings = config["induction"]
    for key, value in (("tokens", args.tokens), ("sequences", args.sequences)):
        if value is not None:
            settings[key] = value
    if args.ablation_sequences is not None:
        settings["ablation"] = {**settings["ablation"], "sequences": args.ablation_sequences}
    out: dict = {"host": platform.node(), "cpu_threads": torch.get_num_threads(), "torch": torch.__version__,
                 "cuda_device": torch.cuda.get_device_name() if gpu else None, "induction": {
                     k: settings[k] for k in ("tokens", "sequences", "fillers", "batch_size")} | {
                     "ablation_sequences": settings["ablation"]["sequences"]}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.trained:
            t0 = time.perf_counter()
            entry = train_run(config, args.trained, tmp / "trained")
            log.info("trained %s in %.1f s", args.trained, time.perf_counter() - t0)
            out[args.trained] = bench_model(args.trained, entry, tmp / "trained", {**settings, "prepend_bos": True},
                                            cpu=True, gpu=gpu, check_device_map=False)
        for names, cpu in ((args.shapes, True), (args.gpu_only, False)):
            for name in filter(None, names.split(",")):
                if not (cpu or gpu):
                    continue
                entry = {"source": {"kind": "build", "seed": 0, **SHAPES[name]}}
                out[name] = bench_model(name, entry, tmp / name, settings, cpu=cpu, gpu=gpu,
                                        check_device_map=not cpu)
                print(json.dumps({name: out[name]}), file=sys.stderr, flush=True)
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
