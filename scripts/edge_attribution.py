"""Snakemake adapter: edge attribution (EAP and exact edge patching) for one model (x checkpoint)."""
import os
from pathlib import Path

if snakemake.params.entry["source"]["kind"] != "hub":
    os.environ["HF_HUB_OFFLINE"] = "1"

from compatlas.worker import hand_off

# run in the run's job server, where torch and transformers are already imported (offline: a hub model's job runs in its own process)
hand_off(snakemake, network=snakemake.params.entry["source"]["kind"] == "hub")

import polars as pl

from compatlas.function.edge_measure import boot_and_attribute_edges
from compatlas.function.exact_shares import merge_exact
from compatlas.logs import exit_now, setup
from compatlas.storage import check_shards, read_shard, write_shard

log = setup(snakemake.log[0], snakemake.threads)
wc = snakemake.wildcards
results = Path(snakemake.output[0]).parents[3]  # results/edge_attribution/model=.../checkpoint=.../edges.parquet
inputs = snakemake.input
check_shards([*inputs.composition, *inputs.shares, *inputs.exact], results)  # a bad one: named, set aside, remade next run
composition = pl.read_parquet(inputs.composition)
shares = [read_shard(p) for p in inputs.shares]  # the sequences' attribution, split
if inputs.exact:  # exact patching split too: merge only, no model booted
    parts = [read_shard(p) for p in inputs.exact]
    edges, provenance = merge_exact(wc.model, inputs.meta, snakemake.params.settings, composition, shares, parts)
else:
    edges, provenance = boot_and_attribute_edges(wc.model, snakemake.params.entry, snakemake.params.checkpoint,
                                                 snakemake.params.settings, inputs.meta, Path(snakemake.params.workdir),
                                                 snakemake.params.device, composition, shares)
write_shard(edges, snakemake.output[0], provenance | {"table": "edge_attribution"})
log.info("wrote %d edge rows in %.1fs", edges.height, provenance["seconds"])
exit_now()  # outputs written: skip the interpreter's teardown
