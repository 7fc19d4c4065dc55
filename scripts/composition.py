"""Snakemake adapter: score one block of layer pairs, and its null pairs, into two Parquet shards."""
import polars as pl

from compatlas.composition.moments import load_moments
from compatlas.composition.scores import block_pairs, null_pairs, touched_layers
from compatlas.composition.table import score_block
from compatlas.logs import exit_now, setup
from compatlas.models.weights import load_weights, shard_n_layers
from compatlas.plan import scored_layers
from compatlas.storage import write_shard
from compatlas.tables import provenance

log = setup(snakemake.log[0], snakemake.threads)
wc, settings = snakemake.wildcards, snakemake.params.settings
layers = scored_layers(snakemake.params.layers, shard_n_layers(snakemake.input.tensors), wc.model)
blocks, block = snakemake.params.blocks, int(wc.block)
pairs, null = block_pairs(layers, blocks, block), null_pairs(layers, blocks, block)
# read only the layers this block touches: at 70B shapes the whole shard is 47 GiB, a layer 0.6 GB
w = load_weights(snakemake.input.tensors, snakemake.input.meta, layers=touched_layers(pairs + null) or layers[:1])
log.info("%s/%s %s %s block %s: %d layer pairs, %d null layer pairs", wc.model, wc.checkpoint, wc.metric, wc.space,
         wc.block, len(pairs), len(null))
moments = load_moments(snakemake.input.moments, snakemake.input.moments_meta) if wc.space == "activation" else None
# one call: the causal and the null pairs share the per-head factors and the nulls' draws
df, facts = score_block(w, wc.metric, wc.space, pairs + null, baseline_samples=settings["baseline_samples"],
                        seed=settings["seed"], device=snakemake.params.device, dtype=snakemake.params.dtype,
                        max_condition=settings["max_condition"], moments=moments)
causal = pl.col("writer_layer") < pl.col("reader_layer")
record = provenance(w.meta, metric=wc.metric, space=wc.space, block=int(wc.block), **facts)
write_shard(df.filter(causal), snakemake.output.causal, record | {"layer_pairs": [list(p) for p in pairs]})
write_shard(df.filter(~causal), snakemake.output.null, record | {"layer_pairs": [list(p) for p in null]})
log.info("wrote %d causal and %d null rows in %.1fs", df.filter(causal).height, df.filter(~causal).height,
         facts["seconds"])
exit_now()  # outputs written: skip the interpreter's teardown
