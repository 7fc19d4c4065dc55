"""Snakemake adapter: p- and q-values of one model x checkpoint's causal pairs against its null pairs."""
from compatlas.calibration import P_SCHEMA, calibrate_shards
from compatlas.logs import setup
from compatlas.storage import library_versions, read_provenance, write_shard_parts

log = setup(snakemake.log[0])
inp, stratify, null_pairs = snakemake.input, snakemake.params.stratify, snakemake.params.null_pairs
first = read_provenance(inp.causal[0])
provenance = {k: first.get(k) for k in ("model", "checkpoint", "checkpoint_step", "processing", "source_checksum",
                                        "weights_sha256", "quantized")}
provenance.update(stratify=stratify, null_pairs=null_pairs, versions=library_versions(), causal_shards=len(inp.causal),
                  null_shards=len(inp.null))
rows = write_shard_parts(calibrate_shards(inp.causal, inp.null, stratify, null_pairs=null_pairs), snakemake.output[0], provenance, P_SCHEMA)
log.info("calibrated %d causal pairs of %s/%s against their null pairs (%s, stratify: %s)",
         rows, first.get("model"), first.get("checkpoint"), null_pairs, stratify)
