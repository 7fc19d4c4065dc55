"""Snakemake adapter: induction sweeps, head scores and ablation for one model (x checkpoint)."""
import os
from pathlib import Path

if snakemake.params.entry["source"]["kind"] != "hub":
    os.environ["HF_HUB_OFFLINE"] = "1"

from compatlas.worker import hand_off

# run in the run's job server, where torch and transformers are already imported (offline: a hub model's job runs in its own process)
hand_off(snakemake, network=snakemake.params.entry["source"]["kind"] == "hub")

from compatlas.behaviour.induction import boot_and_measure_behaviour
from compatlas.logs import exit_now, setup
from compatlas.storage import write_shard

log = setup(snakemake.log[0], snakemake.threads)
wc = snakemake.wildcards
tokens, heads, provenance = boot_and_measure_behaviour(wc.model, snakemake.params.entry, snakemake.params.checkpoint,
                                                       snakemake.params.settings, snakemake.input.meta,
                                                       Path(snakemake.params.workdir), snakemake.params.device)
write_shard(tokens, snakemake.output.tokens, provenance | {"table": "induction_tokens"})
write_shard(heads, snakemake.output.heads, provenance | {"table": "head_scores"})
log.info("wrote %d token rows and %d head rows in %.1fs", tokens.height, heads.height, provenance["seconds"])
exit_now()  # outputs written: skip the interpreter's teardown
