"""`experts:triton_quantized`: the decode GEMV of `kernels/moe_quantized.py` on expert weights stored as FP8 or
NVFP4, dequantized in registers (weight-only: the GEMMs' math in FP32, the activation and output in the model
dtype). Reads only those formats (docs/decisions.md #42), and only decode sizes are offered to it (up to
`moe.GEMV_MAX_PAIRS` routed pairs); past them it still computes the contract with the same kernels.

The kernels are imported on the first call: this module must import without triton, and under the CPU
interpreter TRITON_INTERPRET must be set before they are defined.
"""

from workbench.registry import register
from workbench.variants.kernels.fp8_decode import e4m3_unsupported
from workbench.variants.kernels.moe_decode import decode_supports

FORMATS = ("fp8", "nvfp4")

# BLOCK_N ff rows x BLOCK_K hidden inputs per gate/up step (NVFP4: BLOCK_K / 2 bytes a row); DOWN_BLOCK_N
# hidden rows x DOWN_BLOCK_K ff inputs per down step, for all top_k experts at once; DOWN_WARPS (default
# num_warps) for the down kernel. The first is the default. None spills registers on sm_90 at
# beam-501b-tp8's decode sizes (tests/variants/test_triton_sm90_compile.py).
CONFIGS = [
    dict(BLOCK_N=8, BLOCK_K=512, DOWN_BLOCK_N=16, DOWN_BLOCK_K=64, num_warps=4, num_stages=1),
    dict(BLOCK_N=4, BLOCK_K=1024, DOWN_BLOCK_N=8, DOWN_BLOCK_K=128, num_warps=4, num_stages=1),
    dict(BLOCK_N=8, BLOCK_K=256, DOWN_BLOCK_N=4, DOWN_BLOCK_K=64, num_warps=2, num_stages=1),
]


def _at(config=None):
    config = config or CONFIGS[0]

    def experts_triton_quantized(x, ids, weights, w):
        from workbench.variants.kernels.moe_quantized import quantized_experts  # kernels: imported on use

        return quantized_experts(x, ids, weights, w, config)
    return experts_triton_quantized


_decode_sizes = decode_supports("triton_quantized", "each pair re-reads its expert's weights (a decode GEMV)")


def _supports(wl):
    """Decode sizes on a GPU that loads E4M3 (FP8 weights, and NVFP4's block scales)."""
    return e4m3_unsupported("experts:triton_quantized") or _decode_sizes(wl)


register("experts", "triton_quantized", "triton", supports=_supports,
         configs=CONFIGS, configure=_at, pdl=True, formats=FORMATS)(_at())
