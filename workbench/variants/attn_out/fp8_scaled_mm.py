"""`attn_out:fp8_scaled_mm`: the output gate applied and the gated rows quantized per token to E4M3 in one
launch (`kernels/fp8_rows.py`), then the output projection as an FP8 tensor-core GEMM
(`kernels/fp8_scaled_mm.py`): the FP8 path of prefill sizes. Held to the point's FP8-activation tolerance.
"""

from workbench.registry import register
from workbench.variants.kernels.fp8_scaled_mm import fp8_gemm, quantize_rows, scaled_mm_supports


def _widths(c):
    return [(c.q_width, c.hidden_size)]


@register("attn_out", "fp8_scaled_mm", "triton", formats=("fp8",), activations="fp8",
          supports=scaled_mm_supports("attn_out:fp8_scaled_mm", _widths))
def attn_out_fp8_scaled_mm(o, g, w):
    n, heads, hd = o.shape
    rows = quantize_rows(o.reshape(n, heads * hd), gate=(g, w["gate_bias"], hd))
    return fp8_gemm(*rows, w["o_proj"], o.dtype)
