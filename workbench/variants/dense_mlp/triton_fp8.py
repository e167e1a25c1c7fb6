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
from workbench.variants.kernels.fp8_decode import CONFIGS, decode_supports


def dense_mlp_triton_fp8(x, w, cfg=CONFIGS[0]):
    from workbench.variants.kernels.gemv_fp8 import fp8_linear  # kernels: imported on use

    return fp8_linear(fp8_linear(x, w["gate_proj"], cfg, up=w["up_proj"]), w["down_proj"], cfg)


register("dense_mlp", "triton_fp8", "triton", supports=decode_supports("dense_mlp:triton_fp8"), configs=CONFIGS,
         configure=lambda cfg: functools.partial(dense_mlp_triton_fp8, cfg=cfg),
         pdl=True, formats=("fp8",))(dense_mlp_triton_fp8)
