"""`experts:triton_fp8_grouped`: experts:triton's grouped path (routed pairs sorted by expert, SwiGLU and the
routing weight in the epilogues) on FP8 tensor cores (W8A8: `kernels/moe_quantized_grouped.py`): x and the activation
quantized per token to E4M3, FP8 expert weights read as stored, the scales on the FP32 accumulators. For
prompts and wide decode batches on Hopper (FP8 tensor cores at twice BF16's rate); held to the point's
FP8-activation tolerance.

The kernels are imported on the first call: this module must import without triton, and under the CPU
interpreter TRITON_INTERPRET must be set before they are defined.
"""

from workbench.registry import register
from workbench.variants.experts.triton_quantized_grouped import grouped_supports

# BLOCK_M routed rows x BLOCK_N outputs x BLOCK_K reduction for both GEMMs unless DOWN_* (BLOCK_N, BLOCK_K, WARPS,
# STAGES) give the down GEMM its own; the first is the default (prompts: the fastest at the 8 x 2K prefill on an
# H100, runs/bench-quantized-experts-h100/fp8-prefill-w8a8). The down GEMM reduces over ff (320 at beam-501b-tp8):
# DOWN_BLOCK_K 64 divides it.
CONFIGS = [
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3, DOWN_BLOCK_N=128),
    dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, num_warps=8, num_stages=4, DOWN_BLOCK_N=128, DOWN_BLOCK_K=64),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, DOWN_BLOCK_N=128, DOWN_BLOCK_K=64),
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, DOWN_BLOCK_K=64),
]


def _at(config=None):
    config = config or CONFIGS[0]

    def experts_triton_fp8_grouped(x, ids, weights, w):
        from workbench.variants.kernels.moe_quantized_grouped import quantized_grouped_experts  # imported on use

        return quantized_grouped_experts(x, ids, weights, w, config, w8a8=True)
    return experts_triton_fp8_grouped


# no PDL: the per-token quantization launches (`fp8_rows`) take none
register("experts", "triton_fp8_grouped", "triton", supports=grouped_supports("experts:triton_fp8_grouped"),
         configs=CONFIGS, configure=_at, formats=("fp8",), activations="fp8")(_at())
