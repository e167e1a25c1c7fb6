#!/usr/bin/env bash
# attention:triton's registered fused-merge config (the last split program merges when a decode has at most
# 16 splits) against the same config unfused, with and without PDL, at batch-1 decode over 4K tokens of
# context on both layer kinds, with each call's kernels. Usage (repository root, on a CUDA host): bash THIS OUTDIR
set -euo pipefail
out=$1
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
for layer in sliding full; do
  python3 -m workbench.cli bench attention --variants triton --preset beam-501b-tp8 --dtype bf16 --batch 1 \
    --context 4096 --layer $layer --gate --kernels --out "$out/$layer" \
    --config '{"BLOCK_N":64,"MIN_BLOCKS":1,"WAVES":2,"MAX_SPLITS":256,"num_warps":4,"num_stages":2,"PREFILL_BLOCK_M":64,"PREFILL_BLOCK_N":64,"PREFILL_WARPS":4,"PREFILL_STAGES":2,"FUSED_MERGE_MAX_SPLITS":16,"EARLY_V":false,"pdl":false}' \
    --config '{"BLOCK_N":64,"MIN_BLOCKS":1,"WAVES":2,"MAX_SPLITS":256,"num_warps":4,"num_stages":2,"PREFILL_BLOCK_M":64,"PREFILL_BLOCK_N":64,"PREFILL_WARPS":4,"PREFILL_STAGES":2,"FUSED_MERGE_MAX_SPLITS":16,"EARLY_V":false,"pdl":true}' \
    --config '{"BLOCK_N":64,"MIN_BLOCKS":1,"WAVES":2,"MAX_SPLITS":256,"num_warps":4,"num_stages":2,"PREFILL_BLOCK_M":64,"PREFILL_BLOCK_N":64,"PREFILL_WARPS":4,"PREFILL_STAGES":2,"FUSED_MERGE_MAX_SPLITS":0,"EARLY_V":false,"pdl":false}' \
    --config '{"BLOCK_N":64,"MIN_BLOCKS":1,"WAVES":2,"MAX_SPLITS":256,"num_warps":4,"num_stages":2,"PREFILL_BLOCK_M":64,"PREFILL_BLOCK_N":64,"PREFILL_WARPS":4,"PREFILL_STAGES":2,"FUSED_MERGE_MAX_SPLITS":0,"EARLY_V":false,"pdl":true}'
done
