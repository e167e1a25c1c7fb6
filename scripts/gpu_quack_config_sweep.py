"""Which of quack's GEMM settings run experts:quack_gated's two GEMMs fastest at one MoE layer's 8 x 2K
prefill shapes? The prefill lock of session 22 spent ~1.9 ms a layer in the gated GEMM (~57% of the
measured BF16 matmul rate) and ~0.9 ms in the down GEMM; the variant's configs only ever varied the
tile, pingpong and the CTA cluster. This times, in one process on rows routed as the probe routes
them (`gpu_quack_gated_probe._inputs`), each GEMM at BASE (the variant's config 0 before this sweep)
and at changes to it never tried: quack's dynamic persistent scheduler, its tile swizzle, the K tile,
other tiles. Each setting's output is compared with BASE's (max abs difference: the same products in
the same order give 0), its first call (JIT build included) timed apart from its run time.

    python3 scripts/gpu_quack_config_sweep.py --out FILE [--budget-s 480] [--only gated|down [--changes JSON]]

`--changes '[{"tile_n": 192}, ...]'` times those changes (after BASE) instead of TRIES.

Needs quack-kernels and the CUTLASS DSL imported from a site-packages folder (`scripts/gpu_site.sh`)
and a Hopper GPU. Writes the JSON after every setting, so a run stopped by its budget keeps what it
timed.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from beam_model.config import BeamConfig  # noqa: E402
from gpu_quack_gated_probe import _inputs  # noqa: E402  (this script's folder is on sys.path)
from workbench import bench  # noqa: E402
from workbench.variants import experts__quack as quack_moe  # noqa: E402
from workbench.variants import experts__quack_gated as gated_moe  # noqa: E402

# Each GEMM's settings in experts:quack_gated's config 0 before this sweep (the prefill lock of session 22
# had its config 2: the same gated GEMM, the down GEMM at 128 x 192 pingpong in 2-CTA clusters).
BASE = {
    "gated": dict(tile_m=128, tile_n=160, pingpong=True, cluster_m=2, is_dynamic_persistent=False),
    "down": dict(tile_m=128, tile_n=256, pingpong=False, cluster_m=1, is_dynamic_persistent=False),
}
# Changes to BASE, first the scheduler's (no new tile), then other tiles.
TRIES = {
    "gated": [dict(), dict(is_dynamic_persistent=True), dict(max_swizzle_size=1), dict(max_swizzle_size=4),
              dict(max_swizzle_size=16), dict(tile_k=128), dict(pingpong=False), dict(cluster_m=1),
              dict(tile_m=192, tile_n=128, cluster_m=1), dict(tile_m=256, tile_n=160, pingpong=False),
              dict(tile_m=128, tile_n=320, pingpong=False)],
    "down": [dict(), dict(is_dynamic_persistent=True), dict(max_swizzle_size=1), dict(max_swizzle_size=16),
             dict(cluster_m=2), dict(tile_k=32), dict(tile_n=192, pingpong=True),
             dict(tile_m=256, tile_n=128, cluster_m=2)],
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8 * 2048)
    ap.add_argument("--preset", default="beam-501b-tp8")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=480.0, help="start no new setting after this long")
    ap.add_argument("--only", choices=sorted(TRIES))
    ap.add_argument("--changes", type=json.loads, help="with --only: a JSON list of changes to time instead")
    args = ap.parse_args()
    if args.changes is not None:
        if not args.only:
            ap.error("--changes needs --only (the GEMM they change)")
        TRIES[args.only] = [{}, *args.changes]

    from quack.gemm_config import GemmConfig
    from quack.gemm_interface import gemm_act, gemm_tuned

    c = BeamConfig.from_preset(args.preset)
    x, ids, gate_up, down, _ = _inputs(args.tokens, c)
    cu, rows, _ = quack_moe.sort_pairs(ids, c.n_routed_experts)
    act = gated_moe.gated_gemm(x, gate_up, cu, rows, (128, 160, True, 2))

    def gemm(kind, config):
        if kind == "gated":
            return lambda: gemm_act(x, gate_up.transpose(1, 2), activation="swiglu", cu_seqlens_m=cu, A_idx=rows,
                                    store_preact=False, concat_layout=("B",), tuned=False, config=config)[1]
        out = torch.empty((act.shape[0], down.shape[1]), dtype=act.dtype, device=act.device)

        def down_gemm():  # as experts:quack's grouped_gemm, with the whole config given
            gemm_tuned.fn(act, down.transpose(1, 2), out, cu_seqlens_m=cu, config=config)
            return out
        return down_gemm

    results = {"command": " ".join(sys.argv), "environment": bench.environment("cuda"), "tokens": args.tokens,
               "preset": args.preset, "base": BASE, "timings": []}
    start = time.monotonic()
    for kind in [args.only] if args.only else list(TRIES):
        base = None
        for change in TRIES[kind]:
            if time.monotonic() - start > args.budget_s:
                results["stopped"] = f"budget of {args.budget_s:.0f} s spent before {kind} {change}"
                break
            entry = {"gemm": kind, "change": change}
            try:
                fn = gemm(kind, GemmConfig(**{**BASE[kind], **change, "cluster_n": 1, "device_capacity": 9}))
                t0 = time.monotonic()
                out = fn()
                torch.cuda.synchronize()
                entry["first_call_s"] = round(time.monotonic() - t0, 2)
                timing = bench.time_fn(fn, device="cuda", budget_s=2.0)
                entry.update(median_us=timing["median_us"], spread=timing.get("spread"))
                if base is None:
                    base = out.clone()
                entry["max_abs_diff_vs_base"] = (out.float() - base.float()).abs().max().item()
            except Exception as e:  # a setting quack cannot build or run here: say so and go on
                entry["error"] = f"{type(e).__name__}: {e}"[:400]
            results["timings"].append(entry)
            print(json.dumps(entry), flush=True)
            with open(args.out, "w") as fh:
                json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
