"""`dense_mlp:fp8_scaled_mm`: the SwiGLU MLP's three projections as FP8 tensor-core GEMMs, their inputs
(x once for gate and up, then the activation) quantized per token to E4M3 (`kernels/fp8_scaled_mm.py`);
the activation in FP32 rounded once, as the reference's. Held to the point's FP8-activation tolerance.
"""

import torch

from workbench.registry import register
from workbench.variants.kernels.fp8_scaled_mm import fp8_gemm, fp8_linear, quantize_rows, scaled_mm_supports


def _widths(c):
    return [(c.hidden_size, c.intermediate_size), (c.intermediate_size, c.hidden_size)]


@register("dense_mlp", "fp8_scaled_mm", "triton", formats=("fp8",), activations="fp8",
          supports=scaled_mm_supports("dense_mlp:fp8_scaled_mm", _widths))
def dense_mlp_fp8_scaled_mm(x, w):
    rows = quantize_rows(x)  # once for both GEMMs that read x
    g = fp8_gemm(*rows, w["gate_proj"], x.dtype).float()
    u = fp8_gemm(*rows, w["up_proj"], x.dtype).float()
    return fp8_linear((torch.nn.functional.silu(g) * u).to(x.dtype), w["down_proj"])
