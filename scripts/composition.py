"""Snakemake adapter: score every kernel metric of one space over one block of layer pairs, and
its null pairs, into two Parquet shards per metric."""
from compatlas.worker import hand_off

hand_off(snakemake)  # run in the run's job server, where torch is already imported

from compatlas.composition.shard_job import composition_job
from compatlas.logs import exit_now, setup
from compatlas.models.weights import shard_n_layers
from compatlas.plan import scored_layers

setup(snakemake.log[0], snakemake.threads)
inp, wc, p = snakemake.input, snakemake.wildcards, snakemake.params
# the metrics are the outputs' (not a param: removing a metric from the config reruns no job)
composition_job(inp.tensors, inp.meta, wc.space, snakemake.output.causal, snakemake.output.null,
                layers=scored_layers(p.layers, shard_n_layers(inp.tensors), wc.model), blocks=p.blocks, block=int(wc.block),
                settings=p.settings, device=p.device, dtype=p.dtype,
                moments=(inp.moments, inp.moments_meta) if wc.space == "activation" else None)
exit_now()  # outputs written: skip the interpreter's teardown
