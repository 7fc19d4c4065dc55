"""Snakemake adapter: audit every metric in every space against the axioms."""
from compatlas.worker import hand_off

hand_off(snakemake)  # run in the run's job server, where torch is already imported

from compatlas.audits.metric_audit import run_audit
from compatlas.logs import exit_now, setup
from compatlas.storage import write_shard
from compatlas.tables import provenance

log = setup(snakemake.log[0])
df = run_audit(snakemake.params.metrics, snakemake.params.spaces, snakemake.params.seed)
write_shard(df, snakemake.output[0], provenance(None, seed=snakemake.params.seed))
log.info("metric audit: %d checks, %d passed", df.height, int(df["passed"].sum()))
exit_now()  # outputs written: skip the interpreter's teardown
