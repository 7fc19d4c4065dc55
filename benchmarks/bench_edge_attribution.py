"""Edge attribution's cost against the induction job on the same model, in the same run.

Times, on one model of config/config.yaml (SmolLM2 by default) and on the trained 2-layer model
(trained here, ~15 s): what the induction job computes (``induction.measure_behaviour``: sweep,
head scores, exact ablation) and what the edge attribution job computes
(``edge_measure.attribute_edges``: EAP for every edge plus the exact sample; the clean tokens
timed apart), with the config's settings. Target: edge attribution at most half the induction
job on SmolLM2. The floor it is measured against: one plain forward pass of the same batch
(EAP needs two forwards and a backward; exact patching one forward per ``batch_size / sequences``
edges). Also prints, per method, its Spearman against exact patching and its top edge per comp
beside exact patching's: on the trained model, whether its previous-token head's K edge into an
induction head comes first by each method and by exact patching.

    python benchmarks/bench_edge_attribution.py [--model smollm2-135m] [--trained induction-2l] [--device auto]
        [--methods eap,eap_attn]

Prints JSON; wall and CPU seconds (on a shared machine the CPU time is the steadier figure).
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
from bench_ablation import train_run

from compatlas.behaviour.induction import measure_behaviour
from compatlas.behaviour.tokens import clean_tokens, sample_tokens, token_directions, token_set
from compatlas.function.edge_attribution import induction_task
from compatlas.function.edge_measure import attribute_edges
from compatlas.models.loading import boot
from compatlas.plan import build_plan, thaw
from compatlas.plan.config import validate_config
from compatlas.runtime import resolve_device

REPO = Path(__file__).resolve().parent.parent
log = logging.getLogger("bench_edge_attribution")


def timed(fn, sync):
    sync()
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    sync()
    return out, round(time.perf_counter() - t, 2), round(time.process_time() - c, 2)


def compare(model, settings: dict, sync) -> dict:
    """The induction job's measurements and edge attribution, on the same model."""
    with torch.no_grad():
        W_E = model.W_E.detach().float().cpu()
        W_U = model.W_U.detach().float().cpu()
    out: dict = {"n_layers": model.cfg.n_layers, "n_heads": model.cfg.n_heads}
    _, out["induction_seconds"], out["induction_cpu_seconds"] = timed(
        lambda: measure_behaviour(model, model.tokenizer, token_directions(W_E, W_U), settings, W_E), sync)
    (clean, _), out["clean_tokens_seconds"], _ = timed(
        lambda: clean_tokens(model.tokenizer, W_E, token_directions(W_E, W_U)), sync)
    tokens = token_set(model.tokenizer, sample_tokens(clean, settings["pool"], settings["seed"], "pool"),
                       settings["prepend_bos"])
    edge = settings["edge_attribution"]
    (table, facts), out["edges_seconds"], out["edges_cpu_seconds"] = timed(
        lambda: attribute_edges(model, tokens, edge, settings["seed"]), sync)
    out |= {k: facts[k] for k in ("edges", "exact_edges", "attribution_seconds", "method_seconds", "exact_seconds")}
    # the edge job also finds the clean tokens (the induction job's measure_behaviour includes them)
    out["ratio_edges_vs_induction"] = round((out["edges_seconds"] + out["clean_tokens_seconds"])
                                            / out["induction_seconds"], 3)
    out["cpu_ratio_edges_vs_induction"] = round(out["edges_cpu_seconds"] / out["induction_cpu_seconds"], 3)
    # each method alone, with the exact sample and the clean tokens, as a job running only it would spend
    out["ratio_per_method_vs_induction"] = {
        m: round((t + facts["exact_seconds"] + out["clean_tokens_seconds"]) / out["induction_seconds"], 3)
        for m, t in facts["method_seconds"].items()}
    task = induction_task(tokens, edge["sequences"], edge["length"], settings["seed"])
    x = task.clean[:edge["batch_size"]].to(next(model.parameters()).device)
    with torch.no_grad():
        model(x)
        _, out["one_forward_seconds"], _ = timed(lambda: model(x), sync)
    # in plain forwards of the same batch (None where one forward is below the timer's 0.01 s)
    out["attribution_in_forwards"] = ({m: round(t / out["one_forward_seconds"], 1) for m, t in facts["method_seconds"].items()}
                                      if out["one_forward_seconds"] >= 0.01 else None)
    for method in edge["methods"]:  # per method: agreement with exact patching, top edge per comp
        eap = table.filter(pl.col("method") == method)
        sampled = eap.filter(pl.col("exact").is_not_null())
        mine = out[method] = {"spearman_vs_exact": round(sampled.select(pl.corr("score", "exact", method="spearman")).item(), 3)}
        for c in ("Q", "K", "V"):
            rows = eap.filter(pl.col("comp") == c)
            by = {k: rows.sort(pl.col(k).abs(), descending=True, nulls_last=True).row(0, named=True) for k in ("score", "exact")}
            mine[f"top_{c}_edge"] = {k: f"{r['writer_layer']}.{r['writer_head']} -> {r['reader_layer']}.{r['reader_head']}: "
                                        f"{r[k]:.4f}" for k, r in by.items()}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a model of config/config.yaml ('' to skip)")
    p.add_argument("--trained", default="induction-2l", help="a training run of config/config.yaml ('' to skip)")
    p.add_argument("--device", default="auto")
    p.add_argument("--methods", default="", help="comma-separated edge methods instead of the config's, e.g. eap,eap_attn")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    raw = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config = validate_config(raw)
    plan = build_plan(raw, check_sources=False)  # each model's induction settings, its overrides applied
    dev = resolve_device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out = {"device": str(dev), "host": platform.node(), "cpu_threads": torch.get_num_threads(),
           "edge_settings": {m: thaw(plan.models[m].induction["edge_attribution"]) for m in (args.trained, args.model) if m}}

    def settings(name: str) -> dict:
        ind = thaw(plan.models[name].induction)
        if args.methods:
            ind["edge_attribution"]["methods"] = args.methods.split(",")
            out["edge_settings"][name]["methods"] = ind["edge_attribution"]["methods"]
        return ind

    with tempfile.TemporaryDirectory() as tmp:
        if args.trained:
            model, _ = boot(train_run(config, args.trained, Path(tmp) / "trained"), None, Path(tmp), str(dev))
            out[args.trained] = compare(model.eval(), settings(args.trained), sync)
            print(json.dumps(out[args.trained]), file=sys.stderr, flush=True)
            del model
        if args.model:
            model, _ = boot(config["models"][args.model], None, Path(tmp), str(dev))
            out[args.model] = compare(model.eval(), settings(args.model), sync)
    print(json.dumps(out, indent=2))
    if args.model:
        r = out[args.model]["ratio_edges_vs_induction"]
        methods = "+".join(out["edge_settings"][args.model]["methods"])
        print(f"edge attribution ({methods} for {out[args.model]['edges']} edges + {out[args.model]['exact_edges']} exact) took "
              f"{r}x the induction job's time on {args.model} (target <= 0.5: {'met' if r <= 0.5 else 'NOT met'})",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
