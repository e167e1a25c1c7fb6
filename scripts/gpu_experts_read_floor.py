"""How close is the decode lock's `experts` to a kernel that only reads what it must?
At batch 1 on beam-501b-tp8 a MoE layer's experts read 8 experts' gate, up and down (~79 MB, the
bytes floor of the point). This times, in one process on the GPU, with the workbench's timer
(`bench.time_call`: CUDA graphs of calls back to back), calls that each route to other experts (so the
weights come from HBM, not L2):
- `experts:triton_rows` at the decode lock's config (its two GEMV kernels, with PDL);
- a read-only Triton kernel over the same 8 experts' gate/up and down rows, one launch and two
  (gate/up, then down, as the GEMVs are split): what streaming those bytes costs with no math.
The gap between them is what a better GEMV could still win a layer; the read kernels' gap to the
bytes floor is launch and ramp, which no kernel of this shape avoids.

    python3 scripts/gpu_experts_read_floor.py [--out FILE] [--calls 64]
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from beam_model.config import BeamConfig  # noqa: E402
from workbench import bench, registry  # noqa: E402
from workbench.points import Call  # noqa: E402

LOCK_CONFIG = dict(BLOCK_N=1, num_warps=8, DOWN_BLOCK_N=2, DOWN_WARPS=4, DOWN_STEPS=4, pdl=True)  # the decode lock's


@triton.jit
def _read_rows(ids_ptr, w_ptr, out_ptr, ROWS_PER_EXPERT, ROW, stride_e, CHUNK_ROWS: tl.constexpr,
               BLOCK: tl.constexpr):
    """Program (k, c) sums rows [c * CHUNK_ROWS, ...) of expert ids[k]'s [ROWS_PER_EXPERT, ROW] weight."""
    k, c = tl.program_id(0), tl.program_id(1)
    e = tl.load(ids_ptr + k).to(tl.int64)
    base = w_ptr + e * stride_e + c * CHUNK_ROWS * ROW
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, CHUNK_ROWS * ROW, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        acc += tl.load(base + offs, mask=offs < CHUNK_ROWS * ROW, other=0.0).to(tl.float32)
    tl.store(out_ptr + k * tl.num_programs(1) + c, tl.sum(acc))


def read_experts(ids, w, out, chunk_bytes=65536, block=4096, warps=8):
    e, rows, row = w.shape
    chunk_rows = max(1, chunk_bytes // (row * w.element_size()))  # chunk_bytes a program
    grid = (ids.numel(), triton.cdiv(rows, chunk_rows))
    _read_rows[grid](ids, w, out, rows, row, w.stride(0), CHUNK_ROWS=chunk_rows, BLOCK=block, num_warps=warps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--calls", type=int, default=64, help="routed id sets cycled through")
    args = ap.parse_args()
    c = BeamConfig.from_preset("beam-501b-tp8")
    e, h, f, k = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok
    g = torch.Generator(device="cuda").manual_seed(0)
    w = {"gate_proj": torch.randn(e, f, h, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02,
         "up_proj": torch.randn(e, f, h, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02,
         "down_proj": torch.randn(e, h, f, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02}
    gate_up = torch.cat([w["gate_proj"], w["up_proj"]], dim=1)  # the read kernel's one [E, 2f, h] per expert
    ids = [torch.randperm(e, device="cuda", generator=g)[:k].view(1, k) for _ in range(args.calls)]
    x = torch.randn(1, h, device="cuda", generator=g, dtype=torch.bfloat16)
    weights = torch.rand(1, k, device="cuda", generator=g)
    out = torch.empty(k * h * 2 * f // 1024, device="cuda")  # room for a partial per program at 1 KB ones

    variant = registry.get("experts", "triton_rows")
    fn, prepared = variant.at(LOCK_CONFIG), variant.prepare_weights(w)
    paths = {  # each takes one call's routed ids
        "experts:triton_rows (the decode lock's config)": lambda i: fn(x, i, weights, prepared),
        "read gate/up and down in one launch each (two kernels)":
            lambda i: (read_experts(i, gate_up, out), read_experts(i, w["down_proj"], out)),
        "read gate/up only": lambda i: read_experts(i, gate_up, out),
        "read down only": lambda i: read_experts(i, w["down_proj"], out),
    }
    for chunk, block, warps in ((16384, 2048, 4), (32768, 4096, 4), (32768, 4096, 8), (131072, 8192, 8),
                                (262144, 8192, 16)):
        paths[f"read both, {chunk // 1024} KB a program, BLOCK {block}, {warps} warps"] = \
            lambda i, a=(chunk, block, warps): (read_experts(i, gate_up, out, *a), read_experts(i, w["down_proj"], out, *a))
    moved = k * (3 * f * h) * 2
    ceilings = bench.measure_device_ceilings("cuda")
    result = {"command": " ".join(sys.argv), "environment": bench.environment("cuda"), "id_sets": args.calls,
              "bytes_per_call": moved, "ceilings": ceilings, "timings": {}}
    for label, path in paths.items():
        # One copy per id set, so the rotation cycles through them all: each call reads other experts.
        t = bench.time_call(path, lambda j: Call((ids[j],)), device="cuda", touched_bytes=moved,
                            rotate_bytes=moved * len(ids))
        result["timings"][label] = {"median_us": t.median_us, "spread": t.spread, "graph": t.graph,
                                   "graph_error": t.graph_error}
        print(f"{label}: {t.median_us:.2f} us (spread {t.spread:.3f}, graph {t.graph})", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
