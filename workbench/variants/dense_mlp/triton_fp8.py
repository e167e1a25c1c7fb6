"""`dense_mlp:triton_fp8`: the SwiGLU MLP on FP8 weights through the weight-only FP8 GEMV
(`kernels/gemv_fp8.py`): one launch reads the same rows of gate and up and stores silu(g) * u (g and u
rounded as the reference's GEMMs round them, the activation in FP32, rounded once), a second runs down.
Reads only FP8 weights (docs/decisions.md #42), and only decode sizes are offered to it (up to
`gemv_fp8.MAX_ROWS` rows); past them it still computes the contract.

The kernel is imported on the first call: this module must import without triton, and under the CPU
interpreter TRITON_INTERPRET must be set before the kernel is defined.
"""

import functools

from workbench.registry import register

# One config drives both launches: BLOCK_N weight rows x BLOCK_K inputs a step at one row (the K tile
# shrinks as the rows grow); the first is the default.
CONFIGS = [
    dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=1),
    dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=1),
    dict(BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=2),
]


def _supports(wl):
    from workbench.variants.kernels.gemv_fp8 import MAX_ROWS  # kernels: imported on use

    if wl.dtype not in ("bf16", "fp16", "fp32"):
        return f"dense_mlp:triton_fp8 computes in bf16, fp16 or fp32, not {wl.dtype}"
    if wl.tokens > MAX_ROWS:
        return f"a decode GEMV: past {MAX_ROWS} rows each row tile re-reads the weights"
    return True


def dense_mlp_triton_fp8(x, w, cfg=CONFIGS[0]):
    from workbench.variants.kernels.gemv_fp8 import fp8_linear  # kernels: imported on use

    return fp8_linear(fp8_linear(x, w["gate_proj"], cfg, up=w["up_proj"]), w["down_proj"], cfg)


register("dense_mlp", "triton_fp8", "triton", supports=_supports, configs=CONFIGS, pdl=True, formats=("fp8",),
         configure=lambda cfg: functools.partial(dense_mlp_triton_fp8, cfg=cfg))(dense_mlp_triton_fp8)
