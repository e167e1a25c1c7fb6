#!/usr/bin/env bash
# route:cublas on the H200 at the 8 x 2K prefill's shapes: both configs op-gated and timed beside
# route:triton at every config (eager calls, as the prefill step runs; one bench run, so the ratios
# share a process), with the kernels of one call of each; then the GPU tests of both variants.
# Needs no GPU bundle. Usage (repository root): bash scripts/gpu_route_cublas.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=$1
mkdir -p "$out"
timeout 300 python3 -m workbench.cli bench route --preset beam-501b-tp8 --batch 8 --prefill 2048 --context 2048 \
  --dtype bf16 --variants triton cublas --configs --gate --kernels --no-graph --max-seconds 0.5 \
  --out "$out/bench" > "$out/bench.log" 2>&1
echo "bench: exit $?"
timeout 200 python3 -m pytest -q -m gpu tests/test_route_cublas.py tests/test_triton_route_head_sample.py \
  > "$out/gpu-tests.log" 2>&1
echo "gpu tests: exit $?"
