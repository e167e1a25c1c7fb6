#!/usr/bin/env bash
# The quantized experts variants against the BF16 ones on one beam-501b-tp8 rank, each `workbench bench` one
# process (every row of a table timed in it): decode b1 (experts:triton_quantized_rows and
# experts:triton_quantized at every config, FP8 and NVFP4; BF16 experts:triton_rows and triton; NVFP4 at three
# more tiles: 8 warps, and two gate/up rows a program, whose block inputs pass through shared memory), decode b8,
# decode b64 and the 8 x 2K prefill (experts:triton_quantized_grouped; BF16 experts:triton's grouped path), then
# the two variants' GPU op gate. Ordered by what matters most, so a command's time limit cuts the least.
# Usage (repository root): bash scripts/gpu_bench_quantized_experts.sh DIR
# Writes DIR/bench.txt (every console, each after its command line), DIR/<case>/bench.json and report.md,
# DIR/gpu-tests.log; prints each table's rows.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_bench_quantized_experts.sh DIR}
mkdir -p "$out"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$out/device.txt"
cat "$out/device.txt"
bench() {
  local name=$1 limit=$2
  shift 2
  echo "== $name: workbench bench experts --preset beam-501b-tp8 $*" >> "$out/bench.txt"
  timeout -k 10 "$limit" python3 -m workbench.cli bench experts --preset beam-501b-tp8 "$@" --out "$out/$name" \
    >> "$out/bench.txt" 2>&1
  echo "exit $?" >> "$out/bench.txt"
  sed -n "/^== $name:/,\$p" "$out/bench.txt" | grep -E "^==|^│ [a-z]|floor|^exit" | cut -c1-150
}
bench nvfp4-b1 90 --batch 1 --weights nvfp4 --variants triton_quantized triton_quantized_rows --configs
bench fp8-b1 90 --batch 1 --weights fp8 --variants triton_quantized triton_quantized_rows --configs
bench bf16-b1 60 --batch 1 --variants triton_rows triton
bench nvfp4-b1-more 75 --batch 1 --weights nvfp4 --variants triton_quantized_rows \
  --config '{"BLOCK_N":1,"num_warps":8,"DOWN_BLOCK_N":8,"DOWN_WARPS":8}' \
  --config '{"BLOCK_N":1,"num_warps":8,"STEPS":2,"DOWN_BLOCK_N":16,"DOWN_WARPS":8}' \
  --config '{"BLOCK_N":2,"num_warps":8,"DOWN_BLOCK_N":4,"DOWN_WARPS":4}'
bench nvfp4-b8 90 --batch 8 --weights nvfp4 --variants triton_quantized_rows triton_quantized_grouped
bench bf16-b8 60 --batch 8 --variants triton_rows triton
bench nvfp4-b64 90 --batch 64 --weights nvfp4 --variants triton_quantized_grouped --configs
bench fp8-b64 90 --batch 64 --weights fp8 --variants triton_quantized_grouped
bench bf16-b64 60 --batch 64 --variants triton triton_rounded
bench nvfp4-prefill 120 --batch 8 --prefill 2048 --weights nvfp4 --variants triton_quantized_grouped --configs
bench bf16-prefill 90 --batch 8 --prefill 2048 --variants triton triton_rounded
timeout -k 10 150 python3 -m pytest -q -m gpu tests/variants/test_every_variant.py \
  -k "triton_quantized_rows or triton_quantized_grouped" -p no:cacheprovider > "$out/gpu-tests.log" 2>&1
echo "gpu tests exit $?"; tail -4 "$out/gpu-tests.log"
