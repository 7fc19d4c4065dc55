"""Snakemake adapter: the invariance audit of one model (x checkpoint)."""
from compatlas.worker import hand_off

hand_off(snakemake)  # run in the run's job server, where torch is already imported

from compatlas.audits.invariance import audit, sample_layers
from compatlas.logs import exit_now, setup
from compatlas.models.weights import load_weights
from compatlas.plan import scored_layers
from compatlas.storage import write_shard
from compatlas.tables import provenance

log = setup(snakemake.log[0], snakemake.threads)
p, s = snakemake.params, snakemake.params.settings
w = load_weights(snakemake.input.tensors, snakemake.input.meta)
layers = sample_layers(scored_layers(p.layers, w.n_layers, snakemake.wildcards.model), s["layers"])
log.info("auditing all head pairs of layers %s x %d transforms x %d metrics x %d spaces", layers,
         len(s["transforms"]), len(p.metrics), len(p.spaces))
df = audit(w, p.metrics, p.spaces, transforms=tuple(s["transforms"]), top_k=s["top_k"], seed=p.seed,
           log10_range=s["log10_scale_range"], layers=layers, max_condition=p.max_condition)
write_shard(df, snakemake.output[0], provenance(w.meta, settings=s, layers=layers, seed=p.seed))
log.info("wrote %d rows to %s", df.height, snakemake.output[0])
exit_now()  # outputs written: skip the interpreter's teardown
