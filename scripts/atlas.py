"""Snakemake adapter: (re)build the DuckDB atlas over every shard."""
from compatlas.worker import hand_off

hand_off(snakemake)  # run in the run's job server, where torch is already imported

from compatlas.atlas import build_atlas
from compatlas.function.comp_agreement import agreement_tables
from compatlas.logs import log_peak_memory, setup

log = setup(snakemake.log[0], snakemake.threads)


def as_list(files) -> list[str]:
    return [files] if isinstance(files, str) else list(files)  # one named file arrives as a str


inp = snakemake.input
shards = {"composition": as_list(inp.shards), "composition_null": as_list(inp.null_shards),
          "calibration": as_list(inp.calibration), "invariance": as_list(inp.invariance),
          "metric_audit": as_list(inp.metric_audit), "induction_tokens": as_list(inp.induction_tokens),
          "head_scores": as_list(inp.head_scores), "edge_attribution": as_list(inp.edge_attribution),
          "training_loss": as_list(inp.training_loss)}
thresholds = snakemake.params.thresholds
build_atlas(snakemake.output[0], shards, list(inp.metas), **thresholds,
            computed=lambda con: agreement_tables(con, thresholds["fdr"], workers=snakemake.threads))
log.info("atlas %s: %s shards, %d models", snakemake.output[0], {k: len(v) for k, v in shards.items()},
         len(inp.metas))
log_peak_memory()
