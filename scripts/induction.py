"""Snakemake adapter: induction sweeps, head scores and ablation for one model (x checkpoint)."""
import os
from pathlib import Path

if snakemake.params.entry["source"]["kind"] != "hub":
    os.environ["HF_HUB_OFFLINE"] = "1"

from compatlas.induction import run_model  # noqa: E402
from compatlas.logs import setup  # noqa: E402
from compatlas.storage import write_shard  # noqa: E402

log = setup(snakemake.log[0], snakemake.threads)
wc = snakemake.wildcards
tokens, heads, provenance = run_model(wc.model, snakemake.params.entry, snakemake.params.checkpoint,
                                      snakemake.params.settings, snakemake.input.meta,
                                      Path(snakemake.params.workdir), snakemake.params.device)
write_shard(tokens, snakemake.output.tokens, provenance | {"table": "induction_tokens"})
write_shard(heads, snakemake.output.heads, provenance | {"table": "head_scores"})
log.info("wrote %d token rows and %d head rows in %.1fs", tokens.height, heads.height, provenance["seconds"])
