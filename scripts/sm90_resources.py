"""Registers, local-memory spills and shared memory of `experts:triton`'s decode (GEMV) kernels on an
H200, per tuning config, without a GPU: Triton compiles them for sm_90 on the CPU, and the CUDA
toolkit's `cuobjdump` (in the triton wheel) reads the cubin's resource usage.

A config whose kernel spills (STACK > 0: registers spilled to local memory) streams its weights
slower, whatever the tiles suggest: on the H200, 8 x 1024 gate/up tiles at 2 warps spilled ~4.3 KB a
thread and ran 1.7x slower than the 8 x 512 winner (runs/optimize-decode-b1-beam-501b-tp8/NOTES.md).
Read this before spending device time on a config. The GPU host's Triton may allocate differently.

    python3 scripts/sm90_resources.py [--config JSON ...]   (default: experts.TRITON_CONFIGS' GEMV configs)
"""

import argparse
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # interpreted kernels do not compile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from workbench.sm90 import compile_sm90, resource_usage  # noqa: E402


def gemv_kernels(config: dict, top_k: int) -> dict:
    """Both GEMV kernels of `experts:triton` (gate_up, down) compiled for sm_90 at a GEMV tuning
    config (decode, BF16)."""
    from workbench.variants import _triton_moe as moe

    launch = dict(num_warps=config["num_warps"], num_stages=config["num_stages"])
    gate_up = compile_sm90(moe._gate_up_gemv, dict(
        x_ptr="*bf16", ids_ptr="*i64", wg_ptr="*bf16", wu_ptr="*bf16", act_ptr="*bf16", part_ptr="*fp32",
        count_ptr="*i32", HIDDEN="i32", FF="i32", K_PER_SPLIT="i32", stride_we="i32", stride_wf="i32"), dict(
        TOP_K=top_k, BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"], SPLIT=config.get("SPLIT_K", 1),
        INTERP=False), **launch)
    down = compile_sm90(moe._down_gemv, dict(
        act_ptr="*bf16", ids_ptr="*i64", rw_ptr="*fp32", wd_ptr="*bf16", y_ptr="*bf16", HIDDEN="i32", FF="i32",
        stride_we="i32", stride_wh="i32"), dict(
        TOP_K=top_k, K_P2=1 << (top_k - 1).bit_length(), BLOCK_N=config["DOWN_BLOCK_N"],
        BLOCK_K=config["DOWN_BLOCK_K"], INTERP=False),
        **dict(launch, num_warps=config.get("DOWN_WARPS", config["num_warps"])))
    return {"gate_up": gate_up, "down": down}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", action="append", metavar="JSON", help="a GEMV config (repeatable)")
    p.add_argument("--top-k", type=int, default=8, help="routed experts per token (default: %(default)s)")
    args = p.parse_args()
    from workbench.variants.experts import TRITON_CONFIGS

    configs = [json.loads(c) for c in args.config] if args.config else \
        [c for c in TRITON_CONFIGS if c["path"] == "gemv"]
    for config in configs:
        usage = {name: resource_usage(k) for name, k in gemv_kernels(config, args.top_k).items()}
        spills = " SPILLS" if any(u["STACK"] or u["LOCAL"] for u in usage.values()) else ""
        print(json.dumps({"config": config, **usage}) + spills)
    return 0


if __name__ == "__main__":
    sys.exit(main())
