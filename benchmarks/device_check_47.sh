#!/usr/bin/env bash
# Issue 47's checks in one call: about 5 minutes on one H100 or H200, run from the repository
# root on the device machine (its environment as in benchmarks/README.md, "The prepared device
# script"); the JSON goes to $OUT, and every line starting TARGET says whether a target is met.
#  1. bench_gpu_job.py: the composition rule's job as scripts/composition.py runs it (the
#     block's layers read from a weight shard and checked against their seals, every kernel
#     metric of the residual space, the shards written) against the fp32 floor measured in the
#     same process: GPT-2-small (target <= 0.15 s) and 8 of Llama-2-70B's 80 layers (target >= 0.6
#     of the floor); the read and seal check of one layer; from those the whole 70B checkpoint as
#     the Snakefile plans it, reads included (target <= 12 min);
#  2. bench_blocks.py: 8 blocks (tiles of the layer grid) against one job, Llama-2-70B widths,
#     16 layers (target: the 8 jobs' sum <= 1.3x one job's time).
# `bash benchmarks/device_check_47.sh --cpu` is the same on this machine's CPU, at the shapes a CPU
# runs in minutes (GPT-2-small; blocks at a d_model 1024 shape): target, the rule job within 1.25x of
# its kernel job.
set -euo pipefail
OUT=${OUT:-/tmp/device_check_47}
mkdir -p "$OUT"
if [ "${1:-}" = "--cpu" ]; then
    timeout 1200 python3 benchmarks/bench_gpu_job.py --device cpu --shapes gpt2 --repeats 3 --json "$OUT/gpu_job_cpu.json" \
        | tee "$OUT/gpu_job_cpu.txt"
    timeout 600 python3 benchmarks/bench_blocks.py --device cpu --shape small --layers 16 --blocks 8 --json "$OUT/blocks_cpu.json" \
        | tee "$OUT/blocks_cpu.txt"
else
    timeout 240 python3 benchmarks/bench_gpu_job.py --device cuda --shapes gpt2,llama2-70b-8 --repeats 3 --json "$OUT/gpu_job.json" \
        | tee "$OUT/gpu_job.txt"
    timeout 150 python3 benchmarks/bench_blocks.py --device cuda --layers 16 --blocks 8 --json "$OUT/blocks.json" \
        | tee "$OUT/blocks.txt"
fi
echo "== targets"
grep -h "TARGET\|target <=" "$OUT"/*.txt || true
