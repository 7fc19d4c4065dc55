"""Snakemake adapter: score one block of layer pairs and write its Parquet shard."""
from compatlas.composition import block_pairs
from compatlas.config import selected_layers
from compatlas.logs import setup
from compatlas.scores import score_block
from compatlas.storage import write_shard
from compatlas.weights import load_weights

log = setup(snakemake.log[0])
wc, settings = snakemake.wildcards, snakemake.params.settings
w = load_weights(snakemake.input.tensors, snakemake.input.meta)
layers = selected_layers({"layers": snakemake.params.layers}, w.n_layers, wc.model)
pairs = block_pairs(layers, snakemake.params.blocks, int(wc.block))
log.info("%s/%s %s %s block %s: %d layer pairs", wc.model, wc.checkpoint, wc.metric, wc.space, wc.block, len(pairs))
df, facts = score_block(w, wc.metric, wc.space, pairs, baseline_samples=settings["baseline_samples"],
                        seed=settings["seed"], device=snakemake.params.device, dtype=snakemake.params.dtype,
                        max_condition=settings["max_condition"])
provenance = {k: w.meta.get(k) for k in ("model", "checkpoint", "checkpoint_step", "processing", "source_kind",
                                         "source_checksum", "weights_sha256", "quantized", "versions")}
provenance.update(metric=wc.metric, space=wc.space, block=int(wc.block), **facts)
write_shard(df, snakemake.output[0], provenance)
log.info("wrote %d rows to %s in %.1fs", df.height, snakemake.output[0], facts["seconds"])
