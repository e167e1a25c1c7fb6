#!/usr/bin/env bash
# The decode lock's step against the same step with one fused form swapped in (scripts/gpu_step_swap.py,
# two alternating rounds each): route:triton with its selection in the GEMV kernel's last program
# (fused_select, plain and keyed, with PDL), and experts:triton_persistent (gate/up and down in one
# launch, every config with PDL). Both lost at the op level in the decode search; this asks the step.
# Usage (GPU host, repository root, after the GPU bundle and scripts/gpu_site.sh): bash THIS OUTDIR
set -uo pipefail
out=$1
lock=runs/optimize-decode-b1-beam-501b-tp8/lock.yaml
route() { python3 -c "import json; from workbench.registry import get; print(json.dumps(dict(get('route', 'triton').configs[$1], pdl=True)))"; }
python3 scripts/gpu_step_swap.py $lock route triton --config "$(route 3)" --config "$(route 6)" \
    --out "$out/swap-route-fused-select.json" 2>&1 | grep -v Warning | tee "$out/swap-route-fused-select.log"
persistent=()
while read -r c; do persistent+=(--config "$c"); done < <(python3 -c "
import json; from workbench.registry import get
for c in get('experts', 'triton_persistent').configs: print(json.dumps(dict(c, pdl=True)))")
python3 scripts/gpu_step_swap.py $lock experts triton_persistent "${persistent[@]}" \
    --out "$out/swap-experts-persistent.json" 2>&1 | grep -v Warning | tee "$out/swap-experts-persistent.log"
