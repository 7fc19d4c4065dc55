"""Snakemake adapter: the activation moments of one model (x checkpoint) over the text sample."""
import os
from pathlib import Path

if snakemake.params.entry["source"]["kind"] != "hub":
    os.environ["HF_HUB_OFFLINE"] = "1"

from compatlas.worker import hand_off

# run in the run's job server, where torch and transformers are already imported (offline: a hub model's job runs in its own process)
hand_off(snakemake, network=snakemake.params.entry["source"]["kind"] == "hub")

from compatlas.composition.moments import boot_and_measure_moments, save_moments
from compatlas.logs import exit_now, setup

log = setup(snakemake.log[0], snakemake.threads)
p = snakemake.params
moments, _ = boot_and_measure_moments(snakemake.wildcards.model, p.entry, p.checkpoint, p.settings, p.forward,
                                      snakemake.input.meta, Path(p.workdir), p.device, pattern_output=p.pattern_output)
save_moments(moments, snakemake.output.moments, snakemake.output.meta)
log.info("wrote %s", snakemake.output.moments)
exit_now()  # outputs written: skip the interpreter's teardown
