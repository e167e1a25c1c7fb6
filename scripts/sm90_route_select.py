"""What `route:triton`'s selection kernel compiles to for sm_90 at decode batch 1 (beam-501b-tp8: 256
experts in 8 groups, top 4 groups, top 8 experts, 5 split-K partials, one warp), with and without
the keyed selection (`select_keys`): warp shuffles, barriers and shared-memory accesses in the PTX, and
the cubin's resources, compiled on the CPU (`workbench.sm90`). Why: the keyed form has half the
dependent reductions, yet the decode search timed it slower on the H200
(runs/optimize-decode-b1-beam-501b-tp8/search/route.json, session 27). The GPU host's Triton may
compile differently.

    python3 scripts/sm90_route_select.py > runs/sm90-route-select/ptx-counts.json
"""

import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # interpreted kernels do not compile
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402

from workbench.sm90 import compile_sm90, resource_usage  # noqa: E402
from workbench.variants import route  # noqa: E402

SIGNATURE = dict(part_ptr="*fp32", bias_ptr="*fp32", ids_ptr="*i64", wts_ptr="*fp32", N="i32", E="i32", EPG="i32",
                 scale="fp32", n_split="i32")
SHAPE = dict(SPLIT=5, N_GROUP=8, TOPK_GROUP=4, TOP_K=8, BLOCK_T=1, BLOCK_G=8, BLOCK_J=32, PDL=True)
PATTERNS = {"shfl": r"shfl\.sync", "bar": r"\b(?:bar|barrier)\.sync", "st.shared": r"st\.shared",
            "ld.shared": r"ld\.shared"}


def counts(keyed: bool) -> dict:
    kernel = compile_sm90(route._route_select, SIGNATURE, dict(SHAPE, KEYED=keyed),
                          ints=dict(N=1, E=256, EPG=32, n_split=5), num_warps=1)
    ptx = kernel.asm["ptx"]
    return {**{k: len(re.findall(p, ptx)) for k, p in PATTERNS.items()}, "ptx_lines": len(ptx.splitlines()),
            **resource_usage(kernel)}


if __name__ == "__main__":
    json.dump({"triton": triton.__version__, "shape": SHAPE, "num_warps": 1,
               "two_reductions_a_round": counts(False), "keyed": counts(True)}, sys.stdout, indent=1)
    print()
