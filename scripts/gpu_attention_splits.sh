#!/usr/bin/env bash
# One command for the H200: attention:triton's decode at batch 1 with split layouts the variant's
# config list and the session-10 sweep (MIN_BLOCKS 1, WAVES 2 throughout) never timed:
# - 32K full attention: one wave of splits (WAVES 1), several key blocks per split (MIN_BLOCKS),
#   BLOCK_N 256, each pipelined over num_stages;
# - window-512 decode as one program (MIN_BLOCKS covering the window: no merge kernel) or two.
# Each case also lists the kernels of one call by device time (--kernels), and times the reference and
# the locked decode config in the same run. Configs are passed with --config: no source edit.
# Results: $OUT/<case>/{bench.json,report.md,console.txt}.
# Usage (repository root on the GPU machine): bash scripts/gpu_attention_splits.sh [SECONDS_PER_CASE]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
limit=${1:-60}
out=${OUT:-runs/bench-attention-tp8/splits}

configs() {  # each "BLOCK_N MIN_BLOCKS WAVES num_warps num_stages EARLY_V" -> --config JSON
  local b m w nw ns ev
  while read -r b m w nw ns ev; do
    [ -z "$b" ] && continue
    printf -- "--config\0{\"BLOCK_N\":%s,\"MIN_BLOCKS\":%s,\"WAVES\":%s,\"MAX_SPLITS\":256,\"num_warps\":%s,\"num_stages\":%s,\"EARLY_V\":%s,\"pdl\":true}\0" \
      "$b" "$m" "$w" "$nw" "$ns" "$ev"
  done
}

run_case() {  # name, bench args..., then NUL-separated --config pairs on stdin
  local name=$1; shift
  local extra=()
  while IFS= read -r -d '' a; do extra+=("$a"); done
  mkdir -p "$out/$name"
  timeout -k 5 "$limit" python3 -m workbench.cli bench attention --variants triton --preset beam-501b-tp8 \
    --dtype bf16 --batch 1 "$@" --max-seconds 0.5 --kernels --out "$out/$name" "${extra[@]}" \
    > "$out/$name/console.txt" 2>&1
  echo "[$(date +%T)] $name: exit $?"
}

configs <<'EOF' | run_case full32k --context 32768 --layer full
128 1 2 8 1 false
128 1 1 8 2 false
64 1 1 4 3 false
64 4 2 4 4 false
256 1 2 8 1 false
256 1 2 8 1 true
32 1 1 4 4 false
EOF

configs <<'EOF' | run_case w512 --context 4096 --layer sliding
32 1 2 4 2 false
32 17 2 4 2 false
64 9 2 4 3 false
128 5 2 8 2 false
32 9 2 4 2 false
EOF
