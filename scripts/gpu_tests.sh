#!/usr/bin/env bash
# `pytest -m gpu` on the GPU host, one process per test file under its own time limit (a hang or a
# slow first compile costs that file only), every log in one archive: the device hands back a few
# files per command, so $OUT gets $OUT/gpu-tests.tgz (logs/<file>.log, each ending "exit N").
# Usage (repository root): bash scripts/gpu_tests.sh SECONDS_PER_FILE tests/test_a.py[::test] ...
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
limit=$1
shift
dir=$(mktemp -d)/gpu-tests
mkdir -p "$dir"
for target in "$@"; do
  log="$dir/$(basename "${target%%::*}" .py)${target#"${target%%::*}"}.log"
  log=${log//::/-}
  timeout -k 5 "$limit" python3 -m pytest -m gpu -q -rA --tb=short "$target" > "$log" 2>&1
  echo "exit $?" >> "$log"
  echo "[$(date +%T)] $target: $(tail -2 "$log" | head -1)"
done
if [ -n "${OUT:-}" ]; then tar -C "$(dirname "$dir")" -czf "$OUT/gpu-tests.tgz" gpu-tests; fi
