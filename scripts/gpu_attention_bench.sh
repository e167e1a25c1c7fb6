#!/usr/bin/env bash
# One command for the H200: `workbench bench attention` at beam-501b-tp8 shapes for every attention
# variant side by side (reference, torch_compile, Triton, FlashInfer): decode at batch 1 and 8 over
# 4K and 32K tokens of context (sliding and full layers), prefill of 2K and 8K tokens.
# Each case is its own process under a time limit (a hang or a crash costs that case only).
# Results: runs/bench-attention-tp8/<case>/{bench.json,report.md,console.txt,stderr.log}; with $OUT set,
# also $OUT/bench-attention-tp8.tgz (one file: the device tool returns only a few files per command).
# Usage (repository root on the GPU machine): bash scripts/gpu_attention_bench.sh [SECONDS_PER_CASE]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
limit=${1:-60}
dest=runs/bench-attention-tp8
cases=(
  "decode-b1-4k-sliding  --batch 1 --context 4096 --layer sliding"
  "decode-b1-4k-full     --batch 1 --context 4096 --layer full"
  "decode-b1-32k-full    --batch 1 --context 32768 --layer full"
  "decode-b8-4k-sliding  --batch 8 --context 4096 --layer sliding"
  "decode-b8-32k-full    --batch 8 --context 32768 --layer full"
  "prefill-2k-sliding    --batch 1 --prefill 2048 --context 2048 --layer sliding"
  "prefill-2k-full       --batch 1 --prefill 2048 --context 2048 --layer full"
  "prefill-8k-full       --batch 1 --prefill 8192 --context 8192 --layer full"
)
for c in "${cases[@]}"; do
  read -r name args <<<"$c"
  mkdir -p "$dest/$name"
  # shellcheck disable=SC2086
  timeout -k 5 "$limit" python3 -m workbench.cli bench attention --preset beam-501b-tp8 --dtype bf16 $args \
    --max-seconds 1 --out "$dest/$name" > "$dest/$name/console.txt" 2> "$dest/$name/stderr.log"
  echo "[$(date +%T)] $name: exit $?"
done
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT" && tar -C runs -czf "$OUT/bench-attention-tp8.tgz" bench-attention-tp8; fi
