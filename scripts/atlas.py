"""Snakemake adapter: (re)build the DuckDB atlas over every shard."""
from compatlas.atlas import build_atlas
from compatlas.logs import setup

log = setup(snakemake.log[0])
build_atlas(snakemake.output[0], list(snakemake.input.shards), list(snakemake.input.metas))
log.info("atlas %s: %d composition shards, %d models", snakemake.output[0], len(snakemake.input.shards),
         len(snakemake.input.metas))
