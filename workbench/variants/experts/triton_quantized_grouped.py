"""`experts:triton_quantized_grouped`: experts:triton's grouped path (routed pairs sorted by expert, tensor-core
GEMMs) on expert weights stored as FP8 or NVFP4, each weight tile dequantized exactly in registers before its
dot (W8A16 / W4A16: `kernels/moe_quantized_grouped.py`). For prompts and wide decode batches; the GEMV variants
(`triton_quantized_rows`) serve a few routed pairs.

The kernels are imported on the first call: this module must import without triton, and under the CPU
interpreter TRITON_INTERPRET must be set before they are defined.
"""

from workbench.registry import register
from workbench.variants.experts.triton_quantized import FORMATS
from workbench.variants.kernels.fp8_decode import e4m3_unsupported

# BLOCK_M routed rows x BLOCK_N outputs x BLOCK_K reduction for both GEMMs unless DOWN_* (BLOCK_N, BLOCK_K, WARPS,
# STAGES) give the down GEMM its own, as experts:triton's grouped configs; BLOCK_K at least 32 (NVFP4 reads it
# as whole scale blocks of 16, two codes a byte).
CONFIGS = [
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4),
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3, DOWN_BLOCK_N=128),
    dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, num_warps=8, num_stages=3, DOWN_BLOCK_N=128, DOWN_BLOCK_K=64),
    # wide decode (a few pairs an expert): narrow gate/up tiles over long slices, the down GEMM in ff's 64s
    dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3, DOWN_BLOCK_N=64, DOWN_BLOCK_K=64),
]


def grouped_supports(qualname: str):
    """`supports` of a variant on these grouped kernels: a GPU that loads E4M3 (FP8 weights, and NVFP4's block
    scales; the same GPUs have FP8 tensor cores), a float model dtype."""
    def supports(wl):
        if why := e4m3_unsupported(qualname):
            return why
        if wl.dtype not in ("bf16", "fp16", "fp32"):
            return f"{qualname} computes in bf16, fp16 or fp32, not {wl.dtype}"
        return True
    return supports


def _at(config=None):
    config = config or CONFIGS[0]

    def experts_triton_quantized_grouped(x, ids, weights, w):
        from workbench.variants.kernels.moe_quantized_grouped import quantized_grouped_experts  # imported on use

        return quantized_grouped_experts(x, ids, weights, w, config)
    return experts_triton_quantized_grouped


register("experts", "triton_quantized_grouped", "triton", supports=grouped_supports("experts:triton_quantized_grouped"),
         configs=CONFIGS, configure=_at, pdl=True, formats=FORMATS)(_at())
