#!/usr/bin/env bash
# Issue 38's device checks in one call of about 5 minutes on one H100 or H200, run from the
# repository root on the device machine (its environment as in benchmarks/README.md, "The
# prepared device script"); the JSON goes to $OUT.
#  1. bench_gpu_job.py: the composition rule's job as scripts/composition.py runs it
#     (shard_job.composition_job: a weight shard on disk, every kernel metric of the residual
#     space, the shards written) and score_space, against the fp32 floor measured in the same
#     process: GPT-2-small (target >= 0.3) and 8 of Llama-2-70B's 80 layers (target >= 0.6), and
#     from the latter the whole 70B checkpoint as the Snakefile plans it (target <= 15 min);
#  2. bench_blocks.py: 8 blocks (tiles of the layer grid) against one job, Llama-2-70B widths,
#     16 layers (target: the 8 jobs' sum <= 1.3x one job's time).
set -euo pipefail
OUT=${OUT:-/tmp/device_check_38}
mkdir -p "$OUT"
timeout 200 python3 benchmarks/bench_gpu_job.py --device cuda --shapes gpt2,llama2-70b-8 --repeats 2 --json "$OUT/gpu_job.json"
timeout 150 python3 benchmarks/bench_blocks.py --device cuda --layers 16 --blocks 8 --json "$OUT/blocks.json"
