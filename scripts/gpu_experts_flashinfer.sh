#!/usr/bin/env bash
# experts:flashinfer (FlashInfer's SM90 CuTe-DSL fused MoE) on the H200 at the 8 x 2K prefill's shapes:
# one call with its compile time; every tactic op-gated and timed beside the prefill lock's
# experts:triton_rounded at every config (eager calls, as the prefill step runs; one bench run, so the
# ratios share a process), with the kernels of one call of each; then, in the time left of SECONDS,
# its GPU tests. Needs a GPU bundle with flashinfer and the CUTLASS DSL sourced first.
# Usage (repository root): bash scripts/gpu_experts_flashinfer.sh OUTDIR [SECONDS, default 570]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=$1 deadline=$((SECONDS + ${2:-570}))
mkdir -p "$out"
timeout 200 python3 - > "$out/first-call.log" 2>&1 <<'EOF'
import time, torch
from workbench import registry
from workbench.points import Workload, spec
wl = Workload("beam-501b-tp8", batch=8, tokens_per_seq=2048, context=2048)
v = registry.get("experts", "flashinfer")
print("supports:", v.supports(wl))
call = spec("experts").make_inputs(wl, "cuda", 0)
for i in range(3):
    torch.cuda.synchronize(); t = time.perf_counter()
    y = v.fn(*call.args, **call.kwargs)
    torch.cuda.synchronize()
    print(f"call {i}: {time.perf_counter() - t:.3f} s (the first includes the JIT and CuTe DSL compiles)")
ref = registry.get("experts", "torch").fn(*call.args, **call.kwargs).float()
print("relative error (norms) vs the reference:", ((y.float() - ref).norm() / ref.norm()).item())
EOF
echo "first call: exit $?"
timeout 330 python3 -m workbench.cli bench experts --preset beam-501b-tp8 --batch 8 --prefill 2048 --context 2048 \
  --dtype bf16 --variants triton_rounded flashinfer --configs --gate --kernels --no-graph --max-seconds 0.5 \
  --out "$out/bench" > "$out/bench.log" 2>&1
echo "bench: exit $?"
left=$((deadline - SECONDS))
[ "$left" -gt 30 ] || { echo "no time left for the GPU tests"; exit 0; }
timeout "$left" python3 -m pytest -q -m gpu tests/test_flashinfer_moe.py > "$out/gpu-tests.log" 2>&1
echo "gpu tests: exit $?"
