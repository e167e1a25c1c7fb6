"""FP8 GEMMs on tensor cores with the activations quantized per token, as FP8 serving engines run their
linear layers (vLLM's and TensorRT-LLM's FP8 "W8A8" path): each row of x scaled by its own amax / 448 to
E4M3 (the weights' rule, `quant.formats.quantize_fp8`, on rows of activations; one Triton launch,
`kernels/fp8_rows.py`), then `torch._scaled_mm` with the rows' scales and the weights' output-channel
scales applied to the FP32 accumulator.

What the variants that use it give up: the activations' rounding to 3 mantissa bits, which the reference
(weight-only, docs/decisions.md #42) does not do. Their points hold them to a tolerance of their own
(`PointSpec.activation_tolerance`, with the measurement that sets it). Imports no triton itself.
"""

import torch

from beam_model.quant.tensors import Fp8Weight
from workbench.variants.kernels.fp8_decode import e4m3_unsupported

ALIGN = 16  # _scaled_mm's FP8 operands: the reduction and output widths in multiples of 16


def fp8_linear(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """x [N, in] @ W.T, W an FP8 [out, in] weight with [out, 1] scales: [N, out] in x's dtype."""
    return fp8_gemm(*quantize_rows(x), w, x.dtype)


def quantize_rows(x: torch.Tensor, gate=None) -> tuple[torch.Tensor, torch.Tensor]:
    """x's rows quantized per token (`quantize_fp8`'s rule) in one Triton launch (`kernels/fp8_rows.py`);
    with `gate` (g, bias, head_dim), attention's output gate applied to them first."""
    from workbench.variants.kernels.fp8_rows import quantize_rows as kernel  # kernels: imported on use

    if gate is not None:
        g, bias, head_dim = gate
        gate = (g.contiguous(), bias, head_dim)
    return kernel(x.contiguous(), gate)


def fp8_gemm(codes: torch.Tensor, scale: torch.Tensor, w: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """Rows already quantized (`quantize_fp8`: E4M3 codes [N, in], FP32 scales [N, 1]) @ W.T, in `dtype`
    (the GEMM writes BF16, as row-wise scaled FP8 GEMMs do)."""
    y = torch._scaled_mm(codes, w.weight.t(), scale_a=scale, scale_b=w.scale.t().contiguous(),
                         out_dtype=torch.bfloat16)
    return y.to(dtype)


def scaled_mm_supports(qualname: str, widths):
    """The `supports` of a variant on `fp8_linear`: a GPU that converts E4M3 (sm_89 or later, where the FP8
    tensor cores are too), and `widths(config)`, every (in, out) pair of its GEMMs, in multiples of ALIGN."""
    def supports(wl):
        if why := e4m3_unsupported(qualname):  # its quantization kernel writes E4M3 in Triton
            return why
        odd = [f"{k} x {n}" for k, n in widths(wl.config) if k % ALIGN or n % ALIGN]
        if odd:
            return f"{qualname}: FP8 GEMMs take widths in multiples of {ALIGN}, not {', '.join(odd)}"
        return True
    return supports
