"""Snakemake adapter: score every kernel metric of one space over one block of layer pairs, and
its null pairs, into two Parquet shards per metric."""
from compatlas.worker import hand_off

hand_off(snakemake)  # run in the run's job server, where torch is already imported

import polars as pl

from compatlas.composition.moments import load_moments
from compatlas.composition.scores import block_pairs, null_pairs, touched_layers
from compatlas.composition.table import score_space
from compatlas.logs import exit_now, setup
from compatlas.models.weights import load_weights, shard_n_layers
from compatlas.plan import scored_layers
from compatlas.storage import path_key, write_shard
from compatlas.tables import provenance

log = setup(snakemake.log[0], snakemake.threads)
wc, settings, out = snakemake.wildcards, snakemake.params.settings, snakemake.output
# the metrics are the outputs' (not a param: removing a metric from the config reruns no job)
metrics = tuple(path_key(p, "metric") for p in out.causal)
layers = scored_layers(snakemake.params.layers, shard_n_layers(snakemake.input.tensors), wc.model)
blocks, block = snakemake.params.blocks, int(wc.block)
pairs, null = block_pairs(layers, blocks, block), null_pairs(layers, blocks, block)
# read only the layers this block touches: at 70B shapes the whole shard is 47 GiB, a layer 0.6 GB
w = load_weights(snakemake.input.tensors, snakemake.input.meta, layers=touched_layers(pairs + null) or layers[:1])
log.info("%s/%s %s block %s, %s: %d layer pairs, %d null layer pairs", wc.model, wc.checkpoint, wc.space, wc.block,
         ", ".join(metrics), len(pairs), len(null))
moments = load_moments(snakemake.input.moments, snakemake.input.moments_meta) if wc.space == "activation" else None
# one call: the metrics, the causal and the null pairs share the per-head factors and the nulls' draws
tables, facts = score_space(w, metrics, wc.space, pairs + null, baseline_samples=settings["baseline_samples"],
                            seed=settings["seed"], device=snakemake.params.device, dtype=snakemake.params.dtype,
                            max_condition=settings["max_condition"], moments=moments)
causal = pl.col("writer_layer") < pl.col("reader_layer")
for metric, causal_path, null_path in zip(metrics, out.causal, out.null):
    df = tables[metric]
    record = provenance(w.meta, metric=metric, space=wc.space, block=block, scored_with=list(metrics), **facts)
    write_shard(df.filter(causal), causal_path, record | {"layer_pairs": [list(p) for p in pairs]})
    write_shard(df.filter(~causal), null_path, record | {"layer_pairs": [list(p) for p in null]})
    log.info("%s: wrote %d causal and %d null rows", metric, df.filter(causal).height, df.filter(~causal).height)
log.info("scored in %.1fs", facts["seconds"])
exit_now()  # outputs written: skip the interpreter's teardown
