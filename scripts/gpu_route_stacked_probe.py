"""Would route:cublas gain from one launch over its three BF16 pieces instead of three GEMMs?
At the 8 x 2K prefill the router GEMM is x [16384, 5120] @ [w3; w2; w1]^T with each piece [256, 5120]:
three cuBLAS GEMMs of N 256 (the locked `split` config) against one GEMM of N 768 over the stacked
pieces ([N, 3, E] partials: the selection would need their strides) and one batched GEMM (`bmm`, x
broadcast over the three pieces: the [3, N, E] partials the selection reads now), FP32 out. Same
products, same per-piece sums: the outputs are compared (max abs difference) beside the times.

    python3 scripts/gpu_route_stacked_probe.py --out FILE [--tokens 16384]

Needs a CUDA GPU with torch's `out_dtype` matmuls (BF16 in, FP32 out). Writes the timings as JSON.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from beam_model.config import BeamConfig  # noqa: E402
from workbench import bench  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8 * 2048)
    ap.add_argument("--preset", default="beam-501b-tp8")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    c = BeamConfig.from_preset(args.preset)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.tokens, c.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
    pieces = torch.randn(3, c.n_routed_experts, c.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
    stacked = pieces.reshape(-1, c.hidden_size)  # [w3; w2; w1] as one [3E, K] weight

    def three():
        part = torch.empty((3, args.tokens, c.n_routed_experts), dtype=torch.float32, device="cuda")
        for s in range(3):
            torch.mm(x, pieces[s].t(), out_dtype=torch.float32, out=part[s])
        return part.permute(1, 0, 2)

    def one():
        return torch.mm(x, stacked.t(), out_dtype=torch.float32).view(args.tokens, 3, c.n_routed_experts)

    def batched():
        return torch.bmm(x.expand(3, -1, -1), pieces.transpose(1, 2), out_dtype=torch.float32).permute(1, 0, 2)

    results = {"command": " ".join(sys.argv), "environment": bench.environment("cuda"), "tokens": args.tokens,
               "timings": {}}
    for label, fn in (("three GEMMs, N 256 each (route:cublas split)", three), ("one GEMM, N 768", one),
                      ("one batched GEMM, 3 x N 256", batched)):
        try:
            timing = bench.time_fn(fn, device="cuda", budget_s=3.0)
            entry = {"median_us": timing["median_us"], "spread": timing.get("spread"),
                     "max_abs_diff_vs_three": (fn() - three()).abs().max().item()}
        except Exception as e:  # e.g. a torch without bmm's out_dtype: say so and go on
            entry = {"error": f"{type(e).__name__}: {e}"[:300]}
        results["timings"][label] = entry
        print(label, entry, flush=True)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
