"""Snakemake adapter: p- and q-values of one model x checkpoint's causal pairs against its null pairs."""
from compatlas.worker import hand_off

hand_off(snakemake)  # run in the run's job server, where torch is already imported

from pathlib import Path

from compatlas.composition.calibration import calibrate_shards
from compatlas.logs import exit_now, setup
from compatlas.storage import check_shards, read_provenance, read_sealed_json, write_shard_parts
from compatlas.tables import CALIBRATION_SCHEMA, provenance

log = setup(snakemake.log[0])
inp, stratify, null_pairs = snakemake.input, snakemake.params.stratify, snakemake.params.null_pairs
results = Path(snakemake.output[0]).parents[3]  # results/calibration/model=.../checkpoint=.../pvalues.parquet
check_shards([*inp.causal, *inp.null], results)  # a bad one: named, set aside under results/, remade next run
first = read_provenance(inp.causal[0])
meta = read_sealed_json(inp.meta)  # unchanged since written, of this model (compatlas.models.weights would import torch)
kv_group = int(meta["n_heads"]) // int(meta["n_kv_heads"])
record = provenance(first, stratify=stratify, null_pairs=null_pairs, kv_group=kv_group, causal_shards=len(inp.causal),
                    null_shards=len(inp.null))
rows = write_shard_parts(calibrate_shards(inp.causal, inp.null, stratify, null_pairs=null_pairs, kv_group=kv_group),
                         snakemake.output[0], record, CALIBRATION_SCHEMA)
log.info("calibrated %d causal pairs of %s/%s against their null pairs (%s, stratify: %s; %d query heads per KV head)",
         rows, first.get("model"), first.get("checkpoint"), null_pairs, stratify, kv_group)
exit_now()  # outputs written: skip the interpreter's teardown
