"""`attn_out:triton_fp8_rows`: o_proj on FP8 weights through the whole-row FP8 GEMV
(`kernels/gemv_fp8_rows.py`: each program's rows and scales read before its PDL wait) with the output gate
as its prologue, so the gated activations never go to memory and the gate takes no launch of its own.
Reads only FP8 weights; only decode sizes are offered to it (up to `gemv_fp8_rows.ROWS` rows); past them it
still computes the contract (the gate kernel, then `gemv_fp8`'s row tiles or a dequantized GEMM). Its rows
are short, so besides the projections' configs it tries programs of more rows (`NARROW_CONFIGS`).
"""

import functools

from workbench.registry import register
from workbench.variants.kernels.gemv_fp8_rows import CONFIGS, NARROW_CONFIGS, fp8_rows_linear, supports

# Stored E4M3 weights a thread a program's rows may take: every config within it compiles for sm_90 without spills
# at beam-501b-tp8 (tests/variants/test_triton_sm90_compile.py); past it (beam-small's 2048-input rows in 32-row
# programs) the rows spill registers.
MAX_ELEMENTS_PER_THREAD = 160


def _config_supports(config, wl):
    from workbench.variants.kernels.moe_rows import pieces  # kernels: imported on use

    k = wl.config.num_attention_heads * wl.config.head_dim
    held = config["BLOCK_N"] * sum(pieces(k)) // (32 * config["num_warps"])
    if held > MAX_ELEMENTS_PER_THREAD:
        return (f"{held} E4M3 weights a thread over rows of {k} inputs (more than {MAX_ELEMENTS_PER_THREAD}: they "
                "would spill)")
    return True


def attn_out_triton_fp8_rows(o, g, w, cfg=CONFIGS[0]):
    return fp8_rows_linear(o, w["o_proj"], cfg, gate=(g, w["gate_bias"]))


register("attn_out", "triton_fp8_rows", "triton", supports=supports("attn_out:triton_fp8_rows"),
         configs=CONFIGS + NARROW_CONFIGS, config_supports=_config_supports,
         configure=lambda cfg: functools.partial(attn_out_triton_fp8_rows, cfg=cfg),
         pdl=True, formats=("fp8",))(attn_out_triton_fp8_rows)
