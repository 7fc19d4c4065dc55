"""Snakemake adapter: (re)build the DuckDB atlas over every shard."""
from compatlas.atlas import build_atlas
from compatlas.logs import setup

log = setup(snakemake.log[0])
def as_list(files) -> list[str]:
    return [files] if isinstance(files, str) else list(files)  # one named file arrives as a str


shards = {"composition": as_list(snakemake.input.shards), "invariance": as_list(snakemake.input.invariance),
          "metric_audit": as_list(snakemake.input.metric_audit)}
build_atlas(snakemake.output[0], shards, list(snakemake.input.metas))
log.info("atlas %s: %s shards, %d models", snakemake.output[0], {k: len(v) for k, v in shards.items()},
         len(snakemake.input.metas))
