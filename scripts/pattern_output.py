"""Snakemake adapter: pattern_output's rows of one block of layer pairs, and its null pairs, cut
from the scores the moments rule measured on the model's forward pass."""
from compatlas.worker import hand_off

hand_off(snakemake)  # run in the run's job server, where torch is already imported

import polars as pl

from compatlas.composition.moments import load_moments
from compatlas.composition.scores import block_pairs, null_pairs
from compatlas.composition.table import pattern_output_table
from compatlas.logs import exit_now, setup
from compatlas.models.weights import load_meta
from compatlas.plan import scored_layers
from compatlas.storage import write_shard
from compatlas.tables import provenance

log = setup(snakemake.log[0], snakemake.threads)
wc, out = snakemake.wildcards, snakemake.output
meta = load_meta(snakemake.input.meta)
moments = load_moments(snakemake.input.moments, snakemake.input.moments_meta)
layers = scored_layers(snakemake.params.layers, meta["n_layers"], wc.model)
blocks, block = snakemake.params.blocks, int(wc.block)
pairs, null = block_pairs(layers, blocks, block), null_pairs(layers, blocks, block)
df = pattern_output_table(meta, pairs + null, moments)
causal = pl.col("writer_layer") < pl.col("reader_layer")
record = provenance(meta, metric="pattern_output", space="activation", block=block,
                    pattern_output="the moments rule's forward pass (compatlas.composition.pattern_output)",
                    moments_positions=moments.meta.get("positions"))
write_shard(df.filter(causal), out.causal[0], record | {"layer_pairs": [list(p) for p in pairs]})
write_shard(df.filter(~causal), out.null[0], record | {"layer_pairs": [list(p) for p in null]})
log.info("wrote %d causal and %d null rows", df.filter(causal).height, df.filter(~causal).height)
exit_now()  # outputs written: skip the interpreter's teardown
