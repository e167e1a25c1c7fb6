#!/usr/bin/env bash
# `pytest -m gpu` on the GPU host, one process per test file under its own time limit (a hang or a
# slow first compile costs that file only), every log in one archive: the device hands back a few
# files per command, so $OUT gets $OUT/gpu-tests.tgz (logs/<file>.log, each ending "exit N").
# Usage (repository root): bash scripts/gpu_tests.sh SECONDS_PER_FILE tests/variants/test_a.py[::test] ...
# With GPU_TESTS_UNTIL (epoch seconds: the command's own deadline) no file runs past it, and a file
# left under 30 s is skipped and says so in its log.
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
  left=$(( ${GPU_TESTS_UNTIL:-$(( $(date +%s) + limit ))} - $(date +%s) ))
  if [ "$left" -lt 30 ]; then
    echo "not run: ${left} s left before GPU_TESTS_UNTIL" > "$log"
  else
    timeout -k 5 "$(( left < limit ? left : limit ))" python3 -m pytest -m gpu -q -rA --tb=short "$target" > "$log" 2>&1
    echo "exit $?" >> "$log"
  fi
  echo "[$(date +%T)] $target: $(tail -2 "$log" | head -1)"
done
if [ -n "${OUT:-}" ]; then tar -C "$(dirname "$dir")" -czf "$OUT/gpu-tests.tgz" gpu-tests; fi
