#!/usr/bin/env bash
# attention:triton_prefetch against attention:triton_widemerge (the same decode kernel, a one-round-trip
# merge over 8- or 16-column programs) at batch-1 decode, each config run by both variants in one
# process (the prefetch variant ignores MERGE_BLOCK_D): full attention over 32K keys with the prefetch
# variant's fastest config there and seven changes of it, then the decode lock's window-512 config at 4K context.
# Usage (repository root, on the GPU host): bash runs/attention-read-floor-tp8/widemerge/sweep.sh DIR
set -euo pipefail
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
configs() {  # $1: the base config's changes for this sweep (a python dict), then one per line
  python3 - "$@" <<'PY'
import json, sys
base = dict(BLOCK_N=128, MIN_BLOCKS=1, WAVES=2, MAX_SPLITS=256, num_warps=8, num_stages=1, PREFILL_BLOCK_M=64,
            PREFILL_BLOCK_N=64, PREFILL_WARPS=4, PREFILL_STAGES=2, FUSED_MERGE_MAX_SPLITS=0, EARLY_V=False,
            PREFETCH_V=False, MERGE_BLOCK_D=8, pdl=True)
base.update(eval(sys.argv[1]))
for change in sys.argv[2:]:
    print(json.dumps(dict(base, **eval(change)), separators=(",", ":")))
PY
}
bench() {  # $1: out dir, $2: context, $3: layer, then the configs
  local out=$1 context=$2 layer=$3 args=()
  shift 3
  for c in "$@"; do args+=(--config "$c"); done
  python3 -m workbench.cli bench attention --variants triton_prefetch triton_widemerge --preset beam-501b-tp8 \
    --batch 1 --context "$context" --layer "$layer" --dtype bf16 --gate --kernels --out "$out" "${args[@]}"
}
mapfile -t full32k < <(configs "{}" "{}" "dict(MERGE_BLOCK_D=16)" \
  "dict(BLOCK_N=64, WAVES=4, MAX_SPLITS=512, PREFETCH_V=True)" "dict(BLOCK_N=64, WAVES=4, MAX_SPLITS=512)" \
  "dict(BLOCK_N=64, PREFETCH_V=True)" "dict(BLOCK_N=32, WAVES=8, MAX_SPLITS=1024, num_warps=4, PREFETCH_V=True)" \
  "dict(BLOCK_N=32, WAVES=4, MAX_SPLITS=512, num_warps=4, PREFETCH_V=True)" "dict(num_warps=16, PREFETCH_V=True)")
bench "$1/b1-32k-full" 32768 full "${full32k[@]}"
# the decode lock's attention config (attention:triton_prefetch's BLOCK_N 32, 4 warps, 2 stages, K and V)
mapfile -t win512 < <(configs "dict(BLOCK_N=32, num_warps=4, num_stages=2, PREFETCH_V=True)" "{}" \
  "dict(MERGE_BLOCK_D=16)")
bench "$1/b1-4k-sliding" 4096 sliding "${win512[@]}"
bench "$1/b1-4k-full" 4096 full "${win512[@]}"
