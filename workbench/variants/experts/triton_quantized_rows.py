"""`experts:triton_quantized_rows`: experts:triton_rows' decode GEMV (each program's weight rows loaded whole, a
block of rows at a time, double-buffered) on expert weights stored as FP8 or NVFP4, dequantized in registers,
NVFP4's codes decoded by placing their bits into fp16 (`kernels/moe_quantized_rows.py` says why). Reads only
those formats; only decode sizes are offered to it (up to `moe.GEMV_MAX_PAIRS` routed pairs).

The kernels are imported on the first call: this module must import without triton, and under the CPU
interpreter TRITON_INTERPRET must be set before they are defined.
"""

from workbench.registry import register
from workbench.variants.experts.triton_quantized import FORMATS
from workbench.variants.kernels.fp8_decode import e4m3_unsupported
from workbench.variants.kernels.moe_decode import decode_supports

# BLOCK_N whole gate/up rows per program at num_warps, DOWN_BLOCK_N hidden rows (of all top_k experts) per down
# program at DOWN_WARPS; STEPS / DOWN_STEPS such blocks per program, double-buffered (default 1). The first, the
# fastest in both formats at batch 1 on an H100 (docs/variants.md), is the default. At these
# shapes the products keep the weights' layout (a block's inputs need no trip through shared memory: wider
# gate/up blocks, or down programs of fewer warps, put one CTA barrier per input in each program); none spills on
# sm_90 at beam-501b-tp8's decode sizes (tests/variants/test_triton_sm90_compile.py). A config runs only where
# its stored weight elements a thread stay within MAX_ELEMENTS_PER_THREAD.
CONFIGS = [
    dict(BLOCK_N=1, num_warps=4, STEPS=4, DOWN_BLOCK_N=8, DOWN_WARPS=8, DOWN_STEPS=2),
    dict(BLOCK_N=1, num_warps=4, DOWN_BLOCK_N=8, DOWN_WARPS=8),
    dict(BLOCK_N=1, num_warps=4, STEPS=8, DOWN_BLOCK_N=8, DOWN_WARPS=8, DOWN_STEPS=2),
    dict(BLOCK_N=1, num_warps=4, STEPS=2, DOWN_BLOCK_N=8, DOWN_WARPS=8, DOWN_STEPS=4),
    dict(BLOCK_N=1, num_warps=4, STEPS=4, DOWN_BLOCK_N=4, DOWN_WARPS=8, DOWN_STEPS=4),
]

# Stored weight elements a thread: E4M3 values (FP8), or 64-bit NVFP4 words of 16 codes each decoded in
# registers. Every config above compiles for sm_90 without spills (up to 160 E4M3 values and 10 words a thread at
# beam-501b-tp8); past these limits the tiles are untested.
MAX_ELEMENTS_PER_THREAD = {"fp8": 160, "nvfp4": 32}


def _config_supports(config, wl):
    from workbench.variants.kernels.moe_rows import elements_per_thread

    c, fmt = wl.config, wl.weights
    if fmt not in MAX_ELEMENTS_PER_THREAD:
        return True  # the variant's supports names the format it declines
    unit = 16 if fmt == "nvfp4" else 1  # inputs a stored element: a row of NVFP4 is hidden / 16 words
    per_thread = elements_per_thread(config, c.hidden_size // unit, c.moe_intermediate_size // unit,
                                     c.num_experts_per_tok)
    if per_thread > MAX_ELEMENTS_PER_THREAD[fmt]:
        return f"{per_thread} stored {fmt} weight elements a thread at hidden {c.hidden_size}, ff " \
               f"{c.moe_intermediate_size} (more than {MAX_ELEMENTS_PER_THREAD[fmt]}: the tile would spill registers)"
    return True


_decode_sizes = decode_supports("triton_quantized_rows", "each pair re-reads its expert's weights (a decode GEMV)")


def _supports(wl):
    """Decode sizes on a GPU that loads E4M3 (FP8 weights, and NVFP4's block scales)."""
    return e4m3_unsupported("experts:triton_quantized_rows") or _decode_sizes(wl)


def _at(config=None):
    config = config or CONFIGS[0]

    def experts_triton_quantized_rows(x, ids, weights, w):
        from workbench.variants.kernels.moe_quantized_rows import quantized_experts_rows  # kernels: imported on use

        return quantized_experts_rows(x, ids, weights, w, config)
    return experts_triton_quantized_rows


register("experts", "triton_quantized_rows", "triton", supports=_supports, configs=CONFIGS, configure=_at,
         config_supports=_config_supports, pdl=True, formats=FORMATS)(_at())
