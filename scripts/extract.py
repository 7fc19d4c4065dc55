"""Snakemake adapter: load one model (x checkpoint) and write its attention-weight shard."""
import os
from pathlib import Path

# Sources other than the hub never need the network; say so before transformers is imported.
if snakemake.params.entry["source"]["kind"] != "hub":
    os.environ["HF_HUB_OFFLINE"] = "1"

from compatlas.worker import hand_off

# run in the run's job server, where torch and transformers are already imported (offline: a hub model's job runs in its own process)
hand_off(snakemake, network=snakemake.params.entry["source"]["kind"] == "hub")

from compatlas.composition.token_space import add_space_factors
from compatlas.logs import exit_now, setup
from compatlas.models.loading import load_and_extract
from compatlas.models.weights import save_weights

log = setup(snakemake.log[0], snakemake.threads)
w, _ = load_and_extract(snakemake.wildcards.model, snakemake.params.entry, snakemake.params.checkpoint,
                        Path(snakemake.params.workdir))
add_space_factors(w)  # token-space QR of W_E: once per model
save_weights(w, snakemake.output.tensors, snakemake.output.meta)
log.info("wrote %s", snakemake.output.tensors)
exit_now()  # outputs written: skip the interpreter's teardown
