"""Snakemake adapter: one share of the sequences' edge attribution (every method, every edge) as
sums, for the edge attribution job to merge."""
import os
from pathlib import Path

if snakemake.params.entry["source"]["kind"] != "hub":
    os.environ["HF_HUB_OFFLINE"] = "1"

from compatlas.worker import hand_off

# run in the run's job server (offline: a hub model's job runs in its own process)
hand_off(snakemake, network=snakemake.params.entry["source"]["kind"] == "hub")

from compatlas.function.edge_measure import boot_and_attribute_share
from compatlas.logs import exit_now, setup
from compatlas.storage import write_shard

log = setup(snakemake.log[0], snakemake.threads)
wc, p = snakemake.wildcards, snakemake.params
sums, provenance = boot_and_attribute_share(wc.model, p.entry, p.checkpoint, p.settings, snakemake.input.meta, Path(p.workdir),
                                            int(wc.share), p.settings["edge_attribution"]["jobs"], p.device)
write_shard(sums, snakemake.output[0], provenance | {"table": "edge_sums"})
log.info("wrote share %s's sums (sequences %d to %d) in %.1fs", wc.share, provenance["sequences_from"],
         provenance["sequences_to"], provenance["seconds"])
exit_now()  # outputs written: skip the interpreter's teardown
