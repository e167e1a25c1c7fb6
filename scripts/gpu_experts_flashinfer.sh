#!/usr/bin/env bash
# The CuTe-DSL experts variants (FlashInfer's, quack's) on the H200 at the 8 x 2K prefill's shapes:
# VARIANTS (default flashinfer_down) at every config op-gated and timed beside COMPARE (default
# experts:triton_rounded) at every config (eager calls, as the prefill step runs; one bench run, so the
# ratios share a process; the bench gets BENCH_S seconds, default 300), with the kernels of one call of
# each; then the prefill lock's whole step against the same build with experts swapped to the first of
# VARIANTS at each config (scripts/gpu_step_swap.py, one process); then, in the time left of SECONDS,
# the GPU tests. Needs a GPU bundle with flashinfer and the CUTLASS DSL (and quack, for experts:quack)
# sourced first.
# Usage (repository root): bash scripts/gpu_experts_flashinfer.sh OUTDIR [SECONDS, default 570] [VARIANTS...]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=$1 deadline=$((SECONDS + ${2:-570}))
shift $(( $# < 2 ? $# : 2 ))
variants=("${@:-flashinfer_down}")
mkdir -p "$out"
timeout "${BENCH_S:-300}" python3 -m workbench.cli bench experts --preset beam-501b-tp8 --batch 8 --prefill 2048 --context 2048 \
  --dtype bf16 --variants "${COMPARE:-triton_rounded}" "${variants[@]}" --configs --gate --kernels --no-graph --max-seconds 0.5 \
  --out "$out/bench" > "$out/bench.log" 2>&1
echo "bench: exit $?"
left=$((deadline - SECONDS - 60))
timeout "$left" python3 scripts/gpu_step_swap.py runs/optimize-prefill-8x2k-beam-501b-tp8/lock.yaml experts \
  "${variants[0]}" --all-configs --out "$out/step-swap.json" > "$out/step-swap.log" 2>&1
echo "step swap: exit $?"
left=$((deadline - SECONDS))
[ "$left" -gt 30 ] || { echo "no time left for the GPU tests"; exit 0; }
timeout "$left" python3 -m pytest -q -m gpu tests/test_flashinfer_moe.py tests/test_quack_moe.py > "$out/gpu-tests.log" 2>&1
echo "gpu tests: exit $?"
