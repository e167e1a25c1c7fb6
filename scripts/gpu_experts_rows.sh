#!/usr/bin/env bash
# experts:triton_rows against the decode lock's experts:triton config on the H200, beam-501b-tp8 batch 1:
# every triton_rows config op-gated and timed (CUDA graphs, inputs past L2) with its per-kernel split,
# then the lock's config (with and without PDL) in a second bench run, then Nsight Compute on one call
# of each at its default config (speed of light, occupancy, warp stalls) with NCU=1, if this host's ncu
# reads counters.
# Usage (repository root): [NCU=1] bash scripts/gpu_experts_rows.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=$1
mkdir -p "$out"
bench="python3 -m workbench.cli bench experts --preset beam-501b-tp8 --batch 1 --context 4096 --dtype bf16"
lock='{"path":"gemv","BLOCK_N":8,"BLOCK_K":512,"DOWN_BLOCK_N":4,"DOWN_BLOCK_K":64,"num_warps":2,"num_stages":1'
$bench --variants triton_rows --configs --gate --kernels --max-seconds 1.5 --out "$out/rows" > "$out/rows.log" 2>&1
echo "rows: exit $?"
$bench --variants triton --config "$lock}" --config "$lock,\"pdl\":true}" --gate --kernels --max-seconds 1.5 \
  --out "$out/lock" > "$out/lock.log" 2>&1
echo "lock: exit $?"
[ "${NCU:-0}" = 1 ] || exit 0
ncu="timeout 150 ncu --clock-control none --kernel-name regex:_rows|_gemv --launch-skip 4 --launch-count 2
     --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis"
quick="--no-graph --warmup 3 --min-reps 1 --max-reps 2 --max-seconds 0.01"
$ncu $bench --variants triton_rows $quick > "$out/ncu-rows.txt" 2>&1
echo "ncu rows: exit $?"
$ncu $bench --variants triton --config "$lock}" $quick > "$out/ncu-lock.txt" 2>&1
echo "ncu lock: exit $?"
