"""Head ablation: exact on the cached residual stream vs rerunning the whole model per head,
and attribution patching against exact ablation. Same run, same sequences.

Targets: the exact path (``method="exact"``: the blocks below the ablated head's
layer run once per batch) is at least 2x faster than the reference that reruns the whole
model per head (``method="full"``, the original path), with the same drops (max
difference printed; the tests hold it to 1e-6); attribution patching (one forward and one
backward pass for all heads) is reported by its Spearman correlation with exact ablation over
heads, on SmolLM2 and on the trained 2-layer model (``--trained``, trained here in ~15 s).

    python benchmarks/bench_ablation.py [--model smollm2-135m] [--sequences 8] [--mode zero]
                                        [--trained induction-2l] [--separation 8,32,64] [--device auto]

``--separation S1,S2,..`` also runs exact ablation with max(S) sequences and prints, for the
first S of them per S, the drops of the induction heads (induction score >= induction.induction_threshold) and of
the strongest other heads, with standard errors: how many sequences separate them.
Prints JSON.
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

from compatlas.behaviour.induction import (
    ablation_effects,
    clean_tokens,
    head_attention_scores,
    sample_tokens,
    token_directions,
    token_set,
)
from compatlas.models.loading import boot
from compatlas.plan.config import validate_config
from compatlas.runtime import resolve_device

REPO = Path(__file__).resolve().parent.parent
log = logging.getLogger("bench_ablation")


def spearman(a: pl.Series, b: pl.Series) -> float:
    return pl.DataFrame({"a": a, "b": b}).select(pl.corr("a", "b", method="spearman")).item()


def compare(model, settings: dict, sequences: int, mode: str, batch_size: int, sync, full: bool = True) -> dict:
    """Time full (optional), exact and attribution ablation on the same sequences."""
    with torch.no_grad():
        W_E = model.W_E.detach().float().cpu()
        W_U = model.W_U.detach().float().cpu()
    clean, _ = clean_tokens(model.tokenizer, W_E, token_directions(W_E, W_U))
    tokens = token_set(model.tokenizer, sample_tokens(clean, settings["pool"], 0, "pool"), settings["prepend_bos"])
    before, between = settings["fillers"][0]
    out, frames = {}, {}
    for method in ["exact", "attribution"] + (["full"] if full else []):  # the slow reference last
        sync()
        t, c = time.perf_counter(), time.process_time()
        frames[method] = ablation_effects(model, tokens, sequences=sequences, before=before, between=between, mode=mode,
                                          method=method, seed=0, batch_size=batch_size)
        sync()
        out[f"{method}_seconds"] = round(time.perf_counter() - t, 2)
        # CPU time: on a shared machine the wall time of each side depends on what else runs meanwhile
        out[f"{method}_cpu_seconds"] = round(time.process_time() - c, 2)
        log.info("%s: %s seconds (%s s CPU)", method, out[f"{method}_seconds"], out[f"{method}_cpu_seconds"])
    drops = {m: f["ablation_drop"] for m, f in frames.items()}
    if full:
        out["speedup_exact_vs_full"] = round(out["full_seconds"] / out["exact_seconds"], 2)
        out["cpu_speedup_exact_vs_full"] = round(out["full_cpu_seconds"] / out["exact_cpu_seconds"], 2)
        out["max_abs_drop_diff_exact_vs_full"] = (drops["exact"] - drops["full"]).abs().max()
    out["speedup_attribution_vs_exact"] = round(out["exact_seconds"] / out["attribution_seconds"], 1)
    out["spearman_attribution_vs_exact"] = round(spearman(drops["attribution"], drops["exact"]), 3)
    top = frames["exact"].sort("ablation_drop", descending=True).head(5)
    out["top5_exact"] = [f"{r['layer']}.{r['head']}: {r['ablation_drop']:.3f} +- {r['ablation_drop_stderr']:.3f}"
                         for r in top.iter_rows(named=True)]
    top = frames["attribution"].sort("ablation_drop", descending=True).head(5)
    out["top5_attribution"] = [f"{r['layer']}.{r['head']}: {r['ablation_drop']:.3f}" for r in top.iter_rows(named=True)]
    return out


def separation(model, settings: dict, counts: list[int], mode: str, batch_size: int, threshold: float) -> list[dict]:
    """Exact ablation drops of induction heads vs the rest for the first S of max(counts)
    sequences, per S in counts (one ablation run: the per-sequence drops, prefixes of them)."""
    from compatlas.behaviour.induction import _cached_drops, _draw, _stats, head_z_means, induction_sequences, strengths
    from compatlas.runtime import stable_seed

    with torch.no_grad():
        W_E = model.W_E.detach().float().cpu()
        W_U = model.W_U.detach().float().cpu()
    clean, _ = clean_tokens(model.tokenizer, W_E, token_directions(W_E, W_U))
    tokens = token_set(model.tokenizer, sample_tokens(clean, settings["pool"], 0, "pool"), settings["prepend_bos"])
    hs = settings["head_scores"]
    heads = head_attention_scores(model, tokens, sequences=hs["sequences"], length=hs["length"], seed=0,
                                  batch_size=batch_size)
    before, between = settings["fillers"][0]
    S = max(counts)
    t = time.perf_counter()
    gen = torch.Generator().manual_seed(stable_seed(0, "ablation", before, between))  # as ablation_effects draws
    A = _draw(gen, tokens.pool, (S,))
    B = _draw(gen, tokens.pool, (S,), avoid=(A,))
    seq, ctrl = induction_sequences(gen, tokens, A, B, before, between)
    clean_st = strengths(model, seq, ctrl, B[:, None], batch_size)[:, 0]
    means = head_z_means(model, torch.cat([seq, ctrl]), batch_size) if mode == "mean" else None
    from compatlas.progress import Progress

    L_, H_ = model.cfg.n_layers, model.cfg.n_heads
    drops = _cached_drops(model, seq, ctrl, B[:, None], clean_st, means, batch_size,
                          Progress(log, "separation ablation", 2 * L_ * H_ * S, "head x sequence passes"))  # [L, H, S]
    seconds = time.perf_counter() - t
    L, H = drops.shape[:2]
    is_ind = torch.tensor(heads.sort("layer", "head")["induction_mean"].to_list()).view(L, H) >= threshold
    rows = []
    for n in sorted(counts):
        mean, _, se = _stats(drops[:, :, :n])
        ind_lo = (mean - 2 * se)[is_ind]
        rest_hi = (mean + 2 * se)[~is_ind]
        order = torch.argsort(mean.flatten(), descending=True)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(len(order))
        fmt = lambda i: f"{i // H}.{i % H}: {mean.flatten()[i]:.3f} +- {se.flatten()[i]:.3f}"  # noqa: E731
        rows.append({"sequences": n, "induction_heads": [fmt(int(i)) for i in torch.nonzero(is_ind.flatten()).flatten()],
                     "induction_heads_ranks_by_drop": rank.view(L, H)[is_ind].tolist(),
                     "top_other_heads": [fmt(int(i)) for i in order if not is_ind.flatten()[i]][:5],
                     "min_induction_drop_minus_2se": round(ind_lo.min().item(), 3),
                     "max_other_drop_plus_2se": round(rest_hi.max().item(), 3),
                     "separated_2se": bool(ind_lo.min() > rest_hi.max())})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    rows.append({"seconds_for_all": round(seconds, 1), "heads": L * H})
    return rows


def train_run(config: dict, run: str, workdir: Path) -> dict:
    """Train ``run`` of the config to its last step in one segment; the model entry of the result."""
    from compatlas.models.training import train_segment

    spec = {k: v for k, v in config["training"][run].items() if k not in ("schedule", "description", "spaces", "blocks")}
    train_segment(spec, spec["steps"], None, workdir, run)
    return {"source": {"kind": "local", "path": str(workdir / "hf_model")}}


def trained_model(config: dict, run: str, workdir: Path, device: str):
    model, _ = boot(train_run(config, run, workdir), None, workdir, device)
    return model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a model of config/config.yaml")
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--mode", default="zero", choices=["zero", "mean"])
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--trained", default="induction-2l", help="a training run of config/config.yaml ('' to skip)")
    p.add_argument("--separation", default="", help="comma-separated sequence counts for the separation check")
    p.add_argument("--no-full", action="store_true", help="skip the reference path (whole model per head)")
    p.add_argument("--separation-only", action="store_true", help="only the separation check")
    p.add_argument("--device", default="auto")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)

    config = validate_config(yaml.safe_load((REPO / "config" / "config.yaml").read_text()))
    dev = resolve_device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out = {"device": str(dev), "host": platform.node(), "cpu_threads": torch.get_num_threads(), "mode": args.mode,
           "sequences": args.sequences, "batch_size": args.batch_size}
    with tempfile.TemporaryDirectory() as tmp:
        settings = config["induction"]
        if args.trained and not args.separation_only:  # small: first
            trained = trained_model(config, args.trained, Path(tmp) / "trained", str(dev))
            trained.eval()
            tsettings = {**settings, "prepend_bos": True}
            out[args.trained] = compare(trained, tsettings, args.sequences, args.mode, args.batch_size, sync,
                                        not args.no_full)
            print(json.dumps(out[args.trained]), file=sys.stderr, flush=True)
            del trained
        model, _ = boot(config["models"][args.model], None, Path(tmp), str(dev))
        model.eval()
        if not args.separation_only:
            out[args.model] = compare(model, settings, args.sequences, args.mode, args.batch_size, sync,
                                      not args.no_full)
            print(json.dumps(out[args.model]), file=sys.stderr, flush=True)
        if args.separation:
            out["separation"] = separation(model, settings, [int(s) for s in args.separation.split(",")], args.mode,
                                           args.batch_size, settings["induction_threshold"])
    print(json.dumps(out, indent=2))
    target = out.get(args.model, {}).get("speedup_exact_vs_full")
    if target is not None:
        print(f"exact ablation {target}x faster (wall; {out[args.model]['cpu_speedup_exact_vs_full']}x in CPU time) "
              f"than the whole model per head (target >= 2x: "
              f"{'met' if target >= 2 else 'NOT met'}); drops agree to "
              f"{out[args.model]['max_abs_drop_diff_exact_vs_full']:.1e}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
