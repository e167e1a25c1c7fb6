"""`qkvg_proj:fp8_scaled_mm`: the four projections as one FP8 tensor-core GEMM on their packed rows
(`kernels/packed_qkvg.py`), x quantized per token to E4M3 (`kernels/fp8_scaled_mm.py`): the FP8 path of
prefill sizes, where the weight-only GEMVs of `triton_fp8` stop. Held to the point's FP8-activation
tolerance.
"""

from workbench.registry import register
from workbench.variants.kernels.fp8_scaled_mm import fp8_linear, scaled_mm_supports
from workbench.variants.kernels.packed_qkvg import pack_qkvg, split_qkvg


def _widths(c):
    return [(c.hidden_size, c.q_width + 2 * c.kv_width + c.q_width)]


@register("qkvg_proj", "fp8_scaled_mm", "triton", prepare=pack_qkvg, formats=("fp8",), activations="fp8",
          supports=scaled_mm_supports("qkvg_proj:fp8_scaled_mm", _widths))
def qkvg_fp8_scaled_mm(x, w):
    return split_qkvg(fp8_linear(x, w["qkvg"]), w["sizes"])
