"""`kernels/fp8_rows.py`: the per-token E4M3 quantization kernel gives the rule's codes and scales
(`beam_model.quant.formats.quantize_fp8` on rows of activations), bit for bit: rows of very different
sizes, a row of zeros, values on E4M3's subnormal grid and at its largest value."""

import torch

from beam_model.quant.formats import quantize_fp8


def test_the_kernel_quantizes_each_row_as_the_rule_does():
    from workbench.variants.kernels.fp8_rows import quantize_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1500, generator=g) * torch.tensor([1.0, 80.0, 1e-3, 0.0, 1.0, 3.0])[:, None]
    x[0, :6] = torch.tensor([1e-6, -3e-6, 5e-5, 0.0, 4.0, -4.0])  # subnormal codes beside the row's amax
    x = x.to(torch.bfloat16)
    codes, scale = quantize_rows(x)
    want_codes, want_scale = quantize_fp8(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
    assert torch.equal(scale, want_scale)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
