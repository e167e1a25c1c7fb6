#!/usr/bin/env bash
# experts:flashinfer (FlashInfer's SM90 CuTe-DSL MoE GEMMs) on the H200 at the 8 x 2K prefill's shapes:
# every config op-gated and timed (the first call, with the CuTe DSL compiles, is a column) beside the
# prefill lock's experts:triton_rounded at every config (eager calls, as the prefill step runs; one bench
# run, so the ratios share a process), with the kernels of one call of each; then, in the time left of
# SECONDS, its GPU tests. Needs a GPU bundle with flashinfer and the CUTLASS DSL sourced first.
# Usage (repository root): bash scripts/gpu_experts_flashinfer.sh OUTDIR [SECONDS, default 570]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=$1 deadline=$((SECONDS + ${2:-570}))
mkdir -p "$out"
timeout 330 python3 -m workbench.cli bench experts --preset beam-501b-tp8 --batch 8 --prefill 2048 --context 2048 \
  --dtype bf16 --variants triton_rounded flashinfer --configs --gate --kernels --no-graph --max-seconds 0.5 \
  --out "$out/bench" > "$out/bench.log" 2>&1
echo "bench: exit $?"
left=$((deadline - SECONDS))
[ "$left" -gt 30 ] || { echo "no time left for the GPU tests"; exit 0; }
timeout "$left" python3 -m pytest -q -m gpu tests/test_flashinfer_moe.py > "$out/gpu-tests.log" 2>&1
echo "gpu tests: exit $?"
