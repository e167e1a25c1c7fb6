#!/usr/bin/env bash
# `workbench optimize` on the GPU host across several device commands.
# The device's copy of runs/ is replaced by the checkout's on every command, so the run folder lives
# under /tmp/wb (kept while the host stays up), seeded once from runs/NAME when that exists (a partial
# run committed earlier resumes there), and every command hands the folder back as $OUT/NAME.tgz.
# Usage (repository root): bash scripts/gpu_optimize.sh NAME SECONDS [optimize args...]
#   e.g. bash scripts/gpu_optimize.sh optimize-decode-b1-beam-501b-tp8 540 --target decode-b1 \
#        --preset beam-501b-tp8 --dtype bf16 --budget 420 --candidate-timeout 120
# SECONDS bounds the whole command (optimize stops between points at --budget; the same command resumes;
# a run the watchdog ended, exit 5, is resumed within SECONDS).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
name=$1 limit=$2
shift 2
dir=/tmp/wb/$name
mkdir -p /tmp/wb
if [ ! -d "$dir" ] && [ -d "runs/$name" ]; then cp -r "runs/$name" "$dir"; fi
mkdir -p "$dir/logs"
# Exit code 5: the watchdog ended a stalled candidate; the search resumes at once, skipping it.
deadline=$((SECONDS + limit))
while :; do
  left=$((deadline - SECONDS))
  [ "$left" -gt 30 ] || break
  log="$dir/logs/$(date +%H%M%S).log"
  timeout -k 10 "$left" python3 -m workbench.cli optimize --out "$dir" "$@" > "$log" 2>&1
  rc=$?
  echo "exit $rc" >> "$log"
  tail -25 "$log"
  [ "$rc" -eq 5 ] || break
done
# Traces stay on the host (a prefill-8x2k trace is ~0.5 GB, past what a command hands back).
if [ -n "${OUT:-}" ]; then tar -C /tmp/wb --exclude='*.trace.json' -czf "$OUT/$name.tgz" "$name"; fi
