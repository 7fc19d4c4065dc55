"""The default run's serial tail, the atlas and the report, standalone on a finished run's results
(a copy: the atlas is rebuilt beside its shards under another name), with the inputs and params
workflow/atlas.smk and workflow/report.smk give them (config/config.yaml through compatlas.plan).

    python benchmarks/bench_tail.py RESULTS [--db atlas-bench.duckdb] [--threads N] [--skip-atlas] [--skip-report]
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from pathlib import Path

# as the run's job server has it (compatlas.worker.ONE_BLAS_THREAD), before numpy is imported: with
# one BLAS thread per core on a busy 2-core machine, the atlas's partial bootstraps take 5x longer
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import yaml

from compatlas.plan import build_plan, thaw


def tail_inputs(results: str) -> tuple[dict, list[str], dict, dict]:
    """(shards, metas, thresholds, report config) as the rules hand them (workflow/common.smk)."""
    config = yaml.safe_load(Path("config/config.yaml").read_text())
    config["results"] = results
    plan = build_plan(copy.deepcopy(config), check_sources=False)
    r = results
    shard = r + "/composition/model={model}/checkpoint={checkpoint}/metric={metric}/space={space}/block={block}.parquet"
    pairs = list(plan.pairs())

    def grid(path: str) -> list[str]:
        return [path.format(model=m.name, checkpoint=c.label, metric=me, space=s, block=b)
                for m, c in pairs for me, s in m.cells(plan.metrics) for b in range(m.blocks)]

    induction = [(m, c) for m, c in pairs if m.induction["enabled"]]
    ind = r + "/induction/model={m}/checkpoint={c}/{f}.parquet"
    shards = {"composition": grid(shard), "composition_null": grid(shard.replace("/composition/", "/composition_null/")),
              "calibration": [f"{r}/calibration/model={m.name}/checkpoint={c.label}/pvalues.parquet" for m, c in pairs],
              "invariance": [f"{r}/invariance/model={m.name}/checkpoint={m.last.label}/invariance.parquet"
                             for m in plan.models.values()] if plan.config["invariance"]["enabled"] else [],
              "metric_audit": [f"{r}/metric_audit/metric_audit.parquet"],
              "induction_tokens": [ind.format(m=m.name, c=c.label, f="tokens") for m, c in induction],
              "head_scores": [ind.format(m=m.name, c=c.label, f="heads") for m, c in induction],
              "edge_attribution": [f"{r}/edge_attribution/model={m.name}/checkpoint={c.label}/edges.parquet"
                                   for m, c in induction if m.induction["edge_attribution"]["enabled"]],
              "training_loss": [f"{r}/train/{m.name}/{c.label}/loss.parquet" for m, c in pairs if m.training is not None]}
    metas = [f"{r}/weights/{m.name}/{c.label}/meta.json" for m, c in pairs]
    thresholds = {"prev_token_threshold": thaw(plan.config["induction"]["prev_token_threshold"]),
                  "induction_threshold": thaw(plan.config["induction"]["induction_threshold"]),
                  "fdr": thaw(plan.config["composition"]["fdr"])}
    return shards, metas, thresholds, {**thaw(plan.config), "models": list(plan.models)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("results")
    p.add_argument("--db", default="atlas-bench.duckdb")
    p.add_argument("--report", default="report-bench")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip-atlas", action="store_true")
    p.add_argument("--skip-report", action="store_true")
    a = p.parse_args()
    from compatlas.logs import setup
    setup(str(Path(a.results) / "logs" / "bench-tail.log"), a.threads)
    from compatlas.atlas import build_atlas
    from compatlas.function.comp_agreement import agreement_tables
    from compatlas.report import build_report
    shards, metas, thresholds, report_config = tail_inputs(a.results)
    workers = {"workers": a.threads} if a.threads else {}  # as scripts/atlas.py passes the job's threads
    db = Path(a.results) / a.db
    if not a.skip_atlas:
        t0 = time.perf_counter()
        build_atlas(db, shards, metas, **thresholds, computed=lambda con: agreement_tables(con, thresholds["fdr"], **workers))
        print(f"atlas {time.perf_counter() - t0:.2f} s", flush=True)
    if not a.skip_report:
        t0 = time.perf_counter()
        files = build_report(db, Path(a.results) / a.report, config=report_config)
        print(f"report {time.perf_counter() - t0:.2f} s ({len(files)} files)", flush=True)


if __name__ == "__main__":
    main()
