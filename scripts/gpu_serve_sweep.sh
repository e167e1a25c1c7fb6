#!/usr/bin/env bash
# One command for the H200: a concurrency sweep (1, 8, 32 users) of `workbench serve` with SGLang's
# bench_serving client, plus the server's own model-step times. See scripts/serve_sweep.py.
# Results: $OUT/serve-sweep/ when $OUT is set, else runs/serve-sweep-PRESET/ (sweep.json, report.md,
# server.log, client.log, metrics-last.txt).
#
# The GPU host has no package index: the server's and the client's missing packages travel as wheels
# in .whl/ (git-ignored; `carry: [".whl"]`) and are installed here into /tmp/site. Without .whl/, or
# with --no-install, the packages must already be importable (as on a development machine).
#
# Usage (repository root): bash scripts/gpu_serve_sweep.sh [--preset beam-small] [--lock FILE] [--quick]
#        [--levels 1 8 32] [--input-len 1024] [--output-len 256] [--target-s 45] [--no-install] ...
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
install=1
args=()
for a in "$@"; do
  if [ "$a" = "--no-install" ]; then install=0; else args+=("$a"); fi
done
if [ "$install" = 1 ] && compgen -G ".whl/*.whl" >/dev/null; then
  echo "[gpu_serve_sweep $(date +%H:%M:%S)] installing $(ls .whl/*.whl | wc -l) wheels from .whl/ into /tmp/site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" scripts/serve_sweep.py "${args[@]}"
