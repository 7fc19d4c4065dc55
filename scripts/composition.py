"""Snakemake adapter: score one block of layer pairs, and its null pairs, into two Parquet shards."""
import polars as pl

from compatlas.composition import block_pairs, null_pairs
from compatlas.logs import setup
from compatlas.plan import scored_layers
from compatlas.scores import score_block
from compatlas.storage import write_shard
from compatlas.weights import load_weights

log = setup(snakemake.log[0], snakemake.threads)
wc, settings = snakemake.wildcards, snakemake.params.settings
w = load_weights(snakemake.input.tensors, snakemake.input.meta)
layers = scored_layers(snakemake.params.layers, w.n_layers, wc.model)
blocks, block = snakemake.params.blocks, int(wc.block)
pairs, null = block_pairs(layers, blocks, block), null_pairs(layers, blocks, block)
log.info("%s/%s %s %s block %s: %d layer pairs, %d null layer pairs", wc.model, wc.checkpoint, wc.metric, wc.space,
         wc.block, len(pairs), len(null))
# one call: the causal and the null pairs share the per-head factors and the nulls' draws
df, facts = score_block(w, wc.metric, wc.space, pairs + null, baseline_samples=settings["baseline_samples"],
                        seed=settings["seed"], device=snakemake.params.device, dtype=snakemake.params.dtype,
                        max_condition=settings["max_condition"])
causal = pl.col("writer_layer") < pl.col("reader_layer")
provenance = {k: w.meta.get(k) for k in ("model", "checkpoint", "checkpoint_step", "processing", "source_kind",
                                         "source_revision", "source_commit", "source_checksum", "weights_sha256", "quantized",
                                         "versions")}
provenance.update(metric=wc.metric, space=wc.space, block=int(wc.block), **facts)
write_shard(df.filter(causal), snakemake.output.causal, provenance | {"layer_pairs": [list(p) for p in pairs]})
write_shard(df.filter(~causal), snakemake.output.null, provenance | {"layer_pairs": [list(p) for p in null]})
log.info("wrote %d causal and %d null rows in %.1fs", df.filter(causal).height, df.filter(~causal).height,
         facts["seconds"])
