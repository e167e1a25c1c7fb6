#!/usr/bin/env bash
# The quantized experts variants against the BF16 ones on one beam-501b-tp8 rank, each `workbench bench` one
# process (every row of a table timed in it), gated at the shape where `--gate` is given: decode b64
# (experts:triton_quantized_grouped at its default and three wide-decode tiles, with each kernel's time), b8
# (triton_quantized_rows and the grouped path), b1 (triton_quantized_rows, NVFP4 and FP8), the 8 x 2K prefill
# (experts:triton_fp8_grouped, W8A8, at every config with each kernel's time; triton_quantized_grouped on FP8
# and NVFP4), each beside the BF16 variant it must beat, then the W4A16/W8A16 and W8A8 GPU op gates. Ordered by
# what matters most, so a command's time limit cuts the least.
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
wide='{"BLOCK_M":16,"BLOCK_N":32,"BLOCK_K":256,"num_warps":4,"num_stages":3,"DOWN_BLOCK_N":64,"DOWN_BLOCK_K":64,"pdl":true}'
bench nvfp4-b64 60 --batch 64 --weights nvfp4 --variants triton_quantized_grouped --gate --kernels
bench nvfp4-b64-tiles 100 --batch 64 --weights nvfp4 --variants triton_quantized_grouped \
  --config '{"BLOCK_M":16,"BLOCK_N":64,"BLOCK_K":128,"num_warps":4,"num_stages":4,"DOWN_BLOCK_K":64,"pdl":true}' \
  --config "$wide" \
  --config '{"BLOCK_M":16,"BLOCK_N":64,"BLOCK_K":256,"num_warps":8,"num_stages":3,"DOWN_BLOCK_N":64,"DOWN_BLOCK_K":64,"pdl":true}'
bench bf16-b64 45 --batch 64 --variants triton_rounded
bench nvfp4-b8 70 --batch 8 --weights nvfp4 --variants triton_quantized_rows triton_quantized_grouped --gate
bench bf16-b8 40 --batch 8 --variants triton_rows
bench nvfp4-b64-k 60 --batch 64 --weights nvfp4 --variants triton_quantized_grouped --kernels --config "$wide"
bench nvfp4-b8-tiles 60 --batch 8 --weights nvfp4 --variants triton_quantized_grouped --config "$wide"
bench b1 80 --batch 1 --variants triton_rows
bench nvfp4-b1 50 --batch 1 --weights nvfp4 --variants triton_quantized_rows --gate
bench fp8-b1 50 --batch 1 --weights fp8 --variants triton_quantized_rows --gate
bench fp8-prefill-w8a8 150 --batch 8 --prefill 2048 --weights fp8 --variants triton_fp8_grouped --gate --kernels --configs
bench bf16-prefill 50 --batch 8 --prefill 2048 --variants triton_rounded --kernels
bench fp8-prefill 130 --batch 8 --prefill 2048 --weights fp8 --variants triton_quantized_grouped --gate
bench nvfp4-prefill 90 --batch 8 --prefill 2048 --weights nvfp4 --variants triton_quantized_grouped --gate
timeout -k 10 150 python3 -m pytest -q -m gpu tests/variants/test_every_variant.py \
  -k "triton_quantized_grouped or triton_fp8_grouped" -p no:cacheprovider > "$out/gpu-tests.log" 2>&1
echo "gpu tests exit $?"; tail -4 "$out/gpu-tests.log"
