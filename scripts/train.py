"""Snakemake adapter: train one segment of a run, up to this checkpoint's step.

Training pins its CPU float kernels (compatlas.runtime.pin_cpu_kernels), which torch reads once,
on first use. The run's job server has imported torch but never run it, so the pin takes in its
fork (3 s a job less than a process of its own, mostly importing transformers); where it does not
take, the job reruns in a process of its own, pinned before torch is imported."""
from compatlas.runtime import cpu_kernels, pin_cpu_kernels
from compatlas.worker import hand_off, run_fresh

hand_off(snakemake)
if not pin_cpu_kernels():
    run_fresh()

from pathlib import Path

from compatlas.logs import exit_now, setup
from compatlas.models.training import train_segment
from compatlas.storage import write_shard
from compatlas.tables import provenance

log = setup(snakemake.log[0])
wc = snakemake.wildcards
previous = Path(snakemake.input[0]).parent if len(snakemake.input) else None
out_dir = Path(snakemake.output.state).parent
losses = train_segment(snakemake.params.spec, snakemake.params.step, previous, out_dir, wc.model)
meta = {"model": wc.model, "checkpoint": wc.checkpoint, "checkpoint_step": snakemake.params.step, "source_kind": "trained"}
write_shard(losses, snakemake.output.loss, provenance(meta, step=snakemake.params.step, spec=snakemake.params.spec,
                                                      resumed_from=str(previous), cpu_kernels=cpu_kernels()))
log.info("%s: trained to step %d (%d steps in this segment)", wc.model, snakemake.params.step, losses.height)
exit_now()  # outputs written: skip the interpreter's teardown
