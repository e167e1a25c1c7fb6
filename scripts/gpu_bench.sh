#!/usr/bin/env bash
# One command for the H200: `workbench bench` for every fusion point at beam-501b-tp8 decode shapes,
# batch 1 (attention and qk_prep at context 4096, sliding and full layers), reference and
# every registered variant (or --variants), then one point again to show the run-to-run spread.
# Results: $OUT/bench-tp8-b1/ (when $OUT is set) and runs/bench-tp8-b1/; logs beside them.
# Usage (repository root on the GPU machine): bash scripts/gpu_bench.sh [--budget-s 420] [--repeat boundary]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
exec python3 scripts/gpu_bench.py "$@"
