"""`dense_mlp:triton_fp8_rows`: the SwiGLU MLP on FP8 weights through the whole-row FP8 GEMV
(`kernels/gemv_fp8_rows.py`: each program's rows and scales read before its PDL wait): one launch reads the
same rows of gate and up and stores silu(g) * u, a second runs down. Reads only FP8 weights; only decode
sizes are offered to it (up to `gemv_fp8_rows.ROWS` rows); past them it still computes the contract
(`gemv_fp8`'s row tiles, then a dequantized GEMM).
"""

import functools

from workbench.registry import register
from workbench.variants.kernels.gemv_fp8_rows import CONFIGS, fp8_rows_linear, supports


def dense_mlp_triton_fp8_rows(x, w, cfg=CONFIGS[0]):
    return fp8_rows_linear(fp8_rows_linear(x, w["gate_proj"], cfg, up=w["up_proj"]), w["down_proj"], cfg)


register("dense_mlp", "triton_fp8_rows", "triton", supports=supports("dense_mlp:triton_fp8_rows"), configs=CONFIGS,
         configure=lambda cfg: functools.partial(dense_mlp_triton_fp8_rows, cfg=cfg),
         pdl=True, formats=("fp8",))(dense_mlp_triton_fp8_rows)
