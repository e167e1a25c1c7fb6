"""`attn_out:triton_fp8_rows`: o_proj on FP8 weights through the whole-row FP8 GEMV
(`kernels/gemv_fp8_rows.py`: each program's rows and scales read before its PDL wait) with the output gate
as its prologue, so the gated activations never go to memory and the gate takes no launch of its own.
Reads only FP8 weights; only decode sizes are offered to it (up to `gemv_fp8_rows.ROWS` rows); past them it
still computes the contract (the gate kernel, then `gemv_fp8`'s row tiles or a dequantized GEMM).
"""

import functools

from workbench.registry import register
from workbench.variants.kernels.gemv_fp8_rows import CONFIGS, fp8_rows_linear, supports


def attn_out_triton_fp8_rows(o, g, w, cfg=CONFIGS[0]):
    return fp8_rows_linear(o, w["o_proj"], cfg, gate=(g, w["gate_bias"]))


register("attn_out", "triton_fp8_rows", "triton", supports=supports("attn_out:triton_fp8_rows"), configs=CONFIGS,
         configure=lambda cfg: functools.partial(attn_out_triton_fp8_rows, cfg=cfg),
         pdl=True, formats=("fp8",))(attn_out_triton_fp8_rows)
