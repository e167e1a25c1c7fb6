"""Would holding each MoE layer's gate and up in one [experts, 2 x ff, hidden] weight pay at prefill?
Times, at one layer's 8 x 2K shapes on the GPU, the gate/up half of `experts` several ways, in one process:
- the grouping of the routed pairs by expert: experts:quack's `sort_pairs` against an argsort of the
  int64 ids;
- quack's fused gated GEMM (`gemm_act`, SwiGLU epilogue) over a [gate; up] weight (`concat_layout`),
  gathering the pairs' rows (`A_idx`) in expert groups (`cu_seqlens_m`): reads the gathered rows once;
- experts:quack's path: two grouped GEMMs (gate, up), each gathering the rows, then the SwiGLU kernel;
- the gated GEMM on rows gathered into expert order first (`index_select`), so it loads A by TMA;
- experts:triton_rounded's grouping + `_gate_up_grouped` at the prefill lock's tiles (the lock's gate/up);
and whole experts calls: the prefill lock's experts:flashinfer_down against the gated GEMM followed by
experts:quack's down GEMM and combine.
The concatenated weight is built once here; holding it in the model is the change this probe prices.
The fused epilogue takes the SwiGLU from FP32 accumulators (gate and up are not rounded to the model
dtype first): its largest difference from the two-GEMM path (and the whole call's from the lock's) is
reported beside the times.

    python3 scripts/gpu_quack_gated_probe.py [--tokens 16384] [--out FILE] [--only LABEL_PART ...]

Needs quack-kernels and the CUTLASS DSL (a GPU bundle) and a Hopper GPU. Writes the timings as JSON.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from beam_model.config import BeamConfig  # noqa: E402
from workbench import bench  # noqa: E402
from workbench.variants import experts__quack as quack_moe  # noqa: E402
from workbench.variants import experts__quack_gated as gated_moe  # noqa: E402

# The gated epilogue needs N tiles in multiples of 32 (quack's own config list for "gated").
GATED_TILES = [(128, 160, True, 2), (128, 192, True, 2), (128, 128, True, 2), (256, 160, False, 2)]
TRITON_LOCK = dict(block_m=128, block_n=64, block_k=64, num_warps=8, num_stages=3)  # the prefill lock's


def _inputs(tokens: int, c: BeamConfig, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    e, h, f, k = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok
    x = torch.randn(tokens, h, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.rand(tokens, e, device="cuda", generator=g).topk(k, dim=-1).indices
    gate_up = (torch.randn(e, 2 * f, h, device="cuda", generator=g) / h ** 0.5).to(torch.bfloat16)
    down = (torch.randn(e, h, f, device="cuda", generator=g) / f ** 0.5).to(torch.bfloat16)
    weights = torch.rand(tokens, k, device="cuda", generator=g)
    return x, ids, gate_up, down, weights / weights.sum(-1, keepdim=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8 * 2048)
    ap.add_argument("--preset", default="beam-501b-tp8")
    ap.add_argument("--out")
    ap.add_argument("--only", nargs="*", help="run just the paths whose label holds one of these strings")
    args = ap.parse_args()

    from workbench.variants._triton_moe import grouped_gate_up
    from workbench.variants._triton_moe_grouped_mm import combine_sorted, swiglu
    from workbench.variants.experts__flashinfer_down import experts_flashinfer_down

    c = BeamConfig.from_preset(args.preset)
    f = c.moe_intermediate_size
    x, ids, gate_up, down, weights = _inputs(args.tokens, c)
    gate, up = gate_up[:, :f], gate_up[:, f:]  # views: [gate; up] per expert, as the model would hold them
    cu, rows, pos = quack_moe.sort_pairs(ids, c.n_routed_experts)

    def group_int64():
        """The grouping as sessions 20-21 did it: argsort on the int64 ids (eight radix passes)."""
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        quack_moe.expert_bounds(flat[order], c.n_routed_experts)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return (order // ids.shape[1]).to(torch.int32)

    def fused(tile, a=None):
        """experts:quack_gated's gated GEMM gathering x's rows, or on `a`, rows already in expert order
        (TMA loads)."""
        return lambda: gated_moe.gated_gemm(x if a is None else a, gate_up, cu, rows if a is None else None, tile)

    def gather():
        return x.index_select(0, rows)

    gathered = gather()

    def two_gemms():
        tile = quack_moe.CONFIGS[0]
        gu = (tile["gu_m"], tile["gu_n"], tile["gu_pingpong"], tile["gu_cluster_m"])
        return swiglu(quack_moe.grouped_gemm(x, gate, cu, gu, rows),
                      quack_moe.grouped_gemm(x, up, cu, gu, rows))

    def triton_lock():
        return grouped_gate_up(x, ids.int(), gate, up, **TRITON_LOCK)[2]

    # Whole experts calls: the prefill lock's, and the gated GEMM + experts:quack's down and combine.
    w = {"gate_proj": gate, "up_proj": up, "down_proj": down}
    down_tile = (128, 256, False, 1)

    def lock_experts():
        return experts_flashinfer_down(x, ids, weights, w)

    def fused_experts(tile, pre_gather=False):
        def call():
            act = fused(tile, gather() if pre_gather else None)()
            return combine_sorted(quack_moe.grouped_gemm(act, down, cu, down_tile), pos, weights, ids.shape[1])
        return call

    results = {"command": " ".join(sys.argv), "environment": bench.environment("cuda"), "tokens": args.tokens,
               "preset": args.preset, "timings": {}}
    baselines = {}  # by output shape: the first path of that shape (the two GEMMs, the lock's experts)
    for label, fn in [("group pairs: int64 argsort", group_int64),
                      ("group pairs: sort_pairs", lambda: quack_moe.sort_pairs(ids, c.n_routed_experts)[1]),
                      ("quack two GEMMs + swiglu", two_gemms), ("triton _gate_up_grouped (lock)", triton_lock),
                      *[(f"quack gated {t}", fused(t)) for t in GATED_TILES],
                      ("experts:flashinfer_down (the prefill lock's experts)", lock_experts),
                      *[(f"quack gated {t} + quack down {down_tile} + combine", fused_experts(t))
                        for t in GATED_TILES[:2]],
                      ("gather the pairs' rows (index_select)", gather),
                      *[(f"quack gated {t} on pre-gathered rows", fused(t, gathered)) for t in GATED_TILES],
                      *[(f"gather + quack gated {t} + quack down {down_tile} + combine", fused_experts(t, True))
                        for t in GATED_TILES[:2]]]:
        if args.only and not any(o in label for o in args.only):
            continue
        try:
            out = fn()
            timing = bench.time_fn(fn, device="cuda", budget_s=3.0)
            entry = {"median_us": timing["median_us"], "spread": timing.get("spread")}
            if fn is triton_lock:
                pass  # its rows are tile-padded, in another order
            elif out.shape not in baselines:
                baselines[out.shape] = label, out
            else:
                base_label, base = baselines[out.shape]
                entry[f"max_abs_diff_vs {base_label}"] = (out.float() - base.float()).abs().max().item()
        except Exception as e:  # a config quack cannot build here: say so and go on
            entry = {"error": f"{type(e).__name__}: {e}"[:500]}
        results["timings"][label] = entry
        print(label, entry, flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
