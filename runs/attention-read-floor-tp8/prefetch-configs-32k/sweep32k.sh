#!/usr/bin/env bash
# attention:triton_prefetch at batch-1 full-attention decode over 32K keys: its fastest config there,
# then ten changes of it that no registered config makes, gated and timed in one run.
# Usage (repository root, on the GPU host): bash runs/attention-read-floor-tp8/prefetch-configs-32k/sweep32k.sh DIR
set -euo pipefail
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
mapfile -t configs < <(python3 - <<'PY'
import json
base = dict(BLOCK_N=128, MIN_BLOCKS=1, WAVES=2, MAX_SPLITS=256, num_warps=8, num_stages=1, PREFILL_BLOCK_M=64,
            PREFILL_BLOCK_N=64, PREFILL_WARPS=4, PREFILL_STAGES=2, FUSED_MERGE_MAX_SPLITS=0, EARLY_V=False,
            PREFETCH_V=False, pdl=True)
changes = [{}, dict(BLOCK_N=256), dict(BLOCK_N=256, num_warps=4), dict(BLOCK_N=64, num_warps=4, PREFETCH_V=True),
           dict(BLOCK_N=64, num_warps=4), dict(num_warps=4, PREFETCH_V=True), dict(PREFETCH_V=True), dict(WAVES=1),
           dict(WAVES=1, PREFETCH_V=True), dict(BLOCK_N=64, num_warps=2, PREFETCH_V=True), dict(num_stages=2)]
for change in changes:
    print(json.dumps(dict(base, **change), separators=(",", ":")))
PY
)
args=()
for c in "${configs[@]}"; do args+=(--config "$c"); done
python3 -m workbench.cli bench attention --variants triton_prefetch --preset beam-501b-tp8 --batch 1 --context 32768 \
  --layer full --dtype bf16 --gate --kernels --out "$1" "${args[@]}"
