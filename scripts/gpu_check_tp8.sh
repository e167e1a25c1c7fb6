#!/usr/bin/env bash
# `workbench check --device cuda` at the beam-501b-tp8 shapes of the backends issue: decode at batch 1,
# 8 and 64 with 4K and 32K tokens of context, prefill of 2K and 8K tokens (one sequence and 8 x 2K).
# Each selection (a point, a variant or a backend) runs as its own process with its own time limit, so
# a variant that hangs or builds for minutes costs its own log, not the others'.
# Usage (repository root): bash scripts/gpu_check_tp8.sh DIR SECONDS SELECTION...
#   SELECTION: attention:flashinfer, route:flashinfer, cute, triton, ... (`workbench check` arguments:
#   a backend name is passed as --backend, anything else as the POINT|VARIANT argument).
# Writes DIR/check-SELECTION-{long,short}.log; prints each log's last line.
# JOBS=N runs up to N of those checks at once (default 1): gates check values, not time, so checks may
# share the GPU, and a selection's JIT builds overlap the others' gating.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
dir=$1 limit=$2 jobs=${JOBS:-1}
shift 2
mkdir -p "$dir"
check() {  # LOG SELECTION SHAPES ARGS...: one check under the time limit, then its summary line
  local log=$1 sel=$2 name=$3
  shift 3
  timeout -k 5 "$limit" python3 -m workbench.cli check --device cuda --preset beam-501b-tp8 --dtype bf16 \
    --seeds 2 "$@" > "$log" 2>&1
  echo "exit $?" >> "$log"
  echo "$sel $name: $(grep -E 'passed|Error|error' "$log" | tail -1) ($(tail -1 "$log"))"
}
backends=" torch torch_compile triton flashinfer cute "
for sel in "$@"; do
  if [[ "$backends" == *" $sel "* ]]; then what=(--backend "$sel"); else what=("$sel"); fi
  # long: b1 at 32K, b8/b64 at 4K, one 8K prefill; short: b8/b64 at 32K, 8 x 2K prefill
  for shapes in "long:--batch 1 8 64 --context 32768 4096 --prefill 1 8192 8192" \
                "short:--batch 8 64 --context 32768 32768 --prefill 8 2048 2048"; do
    while (( $(jobs -rp | wc -l) >= jobs )); do wait -n; done
    # shellcheck disable=SC2086
    check "$dir/check-${sel//:/-}-${shapes%%:*}.log" "$sel" "${shapes%%:*}" "${what[@]}" ${shapes#*:} &
  done
done
wait
