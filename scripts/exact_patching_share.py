"""Snakemake adapter: exact edge patching of the drawn sample on one share of the exact sequences,
for the edge attribution job to stack."""
import os
from pathlib import Path

if snakemake.params.entry["source"]["kind"] != "hub":
    os.environ["HF_HUB_OFFLINE"] = "1"

from compatlas.worker import hand_off

# run in the run's job server (offline: a hub model's job runs in its own process)
hand_off(snakemake, network=snakemake.params.entry["source"]["kind"] == "hub")

import polars as pl

from compatlas.function.exact_shares import boot_and_patch_share
from compatlas.logs import exit_now, setup
from compatlas.plan.edge_jobs import exact_jobs
from compatlas.storage import check_shards, read_shard, write_shard

log = setup(snakemake.log[0], snakemake.threads)
wc, p = snakemake.wildcards, snakemake.params
results = Path(snakemake.output[0]).parents[3]  # results/exact_values/model=.../checkpoint=.../share=<j>.parquet
check_shards([*snakemake.input.composition, *snakemake.input.shares], results)  # a bad one: named, set aside, remade next run
composition = pl.read_parquet(snakemake.input.composition)
shares = [read_shard(s) for s in snakemake.input.shares]
values, provenance = boot_and_patch_share(wc.model, p.entry, p.checkpoint, p.settings, snakemake.input.meta, Path(p.workdir),
                                          int(wc.share), exact_jobs(p.settings["edge_attribution"]), p.device,
                                          composition, shares)
write_shard(values, snakemake.output[0], provenance | {"table": "exact_values"})
log.info("wrote share %s's exact values (sequences %d to %d) in %.1fs", wc.share, provenance["sequences_from"],
         provenance["sequences_to"], provenance["seconds"])
exit_now()  # outputs written: skip the interpreter's teardown
