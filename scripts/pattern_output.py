"""Snakemake adapter: pattern_output's rows of one block of layer pairs, and its null pairs, cut
from the scores the moments rule measured on the model's forward pass."""
from compatlas.worker import hand_off

hand_off(snakemake)  # run in the run's job server, where torch is already imported

from compatlas.composition.shard_job import pattern_output_job
from compatlas.logs import exit_now, setup
from compatlas.models.weights import load_meta
from compatlas.plan import scored_layers

setup(snakemake.log[0], snakemake.threads)
inp, p = snakemake.input, snakemake.params
pattern_output_job(inp.meta, (inp.moments, inp.moments_meta), snakemake.output.causal[0], snakemake.output.null[0],
                   layers=scored_layers(p.layers, load_meta(inp.meta)["n_layers"], snakemake.wildcards.model),
                   blocks=p.blocks, block=int(snakemake.wildcards.block))
exit_now()  # outputs written: skip the interpreter's teardown
