"""Snakemake adapter: p- and q-values of one model x checkpoint's causal pairs against its null pairs."""
from compatlas.calibration import calibrate_shards
from compatlas.logs import exit_now, setup
from compatlas.storage import read_provenance, write_shard_parts
from compatlas.tables import CALIBRATION_SCHEMA, provenance

log = setup(snakemake.log[0])
inp, stratify, null_pairs = snakemake.input, snakemake.params.stratify, snakemake.params.null_pairs
first = read_provenance(inp.causal[0])
record = provenance(first, stratify=stratify, null_pairs=null_pairs, causal_shards=len(inp.causal),
                    null_shards=len(inp.null))
rows = write_shard_parts(calibrate_shards(inp.causal, inp.null, stratify, null_pairs=null_pairs), snakemake.output[0],
                         record, CALIBRATION_SCHEMA)
log.info("calibrated %d causal pairs of %s/%s against their null pairs (%s, stratify: %s)",
         rows, first.get("model"), first.get("checkpoint"), null_pairs, stratify)
exit_now()  # outputs written: skip the interpreter's teardown
