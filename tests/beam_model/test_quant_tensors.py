"""The quantized weights the model and the points hold: their values are the checkpoint formats'
dequantization, indexing the experts' stack commutes with dequantizing, and the harness's walkers see
their tensors."""

import pytest
import torch

from beam_model.quant import formats
from beam_model.quant.tensors import Fp8Weight, Nvfp4Weight, dense, is_quantized, quantize, weight_format
from workbench.points import leaves, map_leaves


def _stack(seed=0, experts=3, rows=8, cols=32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(experts, rows, cols, generator=g) * torch.linspace(0.1, 3.0, cols)


def test_fp8_stack_is_the_per_matrix_format():
    w = _stack()
    q = quantize(w, "fp8")
    assert isinstance(q, Fp8Weight) and q.shape == w.shape and q.scale.shape == (3, 8, 1)
    for e in range(3):
        weight, scale = formats.quantize_fp8(w[e])
        assert torch.equal(q.weight[e].float(), weight.float()) and torch.equal(q.scale[e], scale)
        assert torch.equal(q[e].dequantize(), formats.dequantize_fp8(weight, scale))


def test_nvfp4_stack_is_the_per_matrix_format_with_a_global_scale_each():
    w = _stack()
    w[1] *= 50.0  # another expert's range: its own global scale
    q = quantize(w, "nvfp4")
    assert isinstance(q, Nvfp4Weight) and q.shape == w.shape and q.weight.shape == (3, 8, 16)
    assert q.scale_2.shape == (3,) and q.scale_2[1] > 10 * q.scale_2[0]
    for e in range(3):
        weight, scale, scale_2 = formats.quantize_nvfp4(w[e])
        assert torch.equal(q.weight[e], weight) and torch.equal(q.scale_2[e], scale_2)
        assert torch.equal(q[e].dequantize(), formats.dequantize_nvfp4(weight, scale, scale_2))


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_indexing_selects_experts_without_changing_their_values(fmt):
    q = quantize(_stack(1), fmt)
    ids = torch.tensor([[2, 0], [1, 2]])
    assert torch.equal(q[ids].dequantize(), q.dequantize()[ids])
    assert q[ids].shape == (2, 2, 8, 32)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_dense_reads_either_kind_in_the_asked_dtype(fmt):
    w = _stack(2)[0].bfloat16()
    assert dense(w, torch.float32) is w and weight_format(w) == "bf16" and not is_quantized(w)
    q = quantize(w, fmt)
    assert is_quantized(q) and weight_format(q) == fmt
    d = dense(q, torch.bfloat16)
    assert d.dtype == torch.bfloat16 and torch.equal(d, q.dequantize().bfloat16())
    bound = 2 ** -4 if fmt == "fp8" else 0.26  # a step of the format, relative to the row's / tensor's amax
    scale = w.float().abs().amax(-1, keepdim=True) if fmt == "fp8" else w.float().abs().max()
    assert ((q.dequantize() - w.float()).abs() <= bound * scale).all()


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_the_harness_walks_and_copies_their_tensors(fmt):
    q = quantize(_stack(3), fmt)
    call = {"gate_proj": q, "norm": torch.ones(4)}
    assert len(leaves(call)) == (3 if fmt == "fp8" else 4)
    copy = map_leaves(call, lambda t: t.clone())
    assert type(copy["gate_proj"]) is type(q) and copy["gate_proj"].weight is not q.weight
    assert torch.equal(copy["gate_proj"].dequantize(), q.dequantize())


def test_an_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unknown weight format 'int4'"):
        quantize(torch.ones(2, 16), "int4")


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_a_float64_dequantization_is_exact(fmt):
    """The gates' reference runs in FP64: the stored values times their scales, rounded nowhere."""
    q = quantize(_stack(4), fmt)
    d64 = q.dequantize(torch.float64)
    if fmt == "fp8":
        exact = q.weight.double() * q.scale.double()
    else:
        codes = torch.stack((q.weight & 15, q.weight >> 4), -1).flatten(-2)
        exact = formats.e2m1_values(codes).double() * q.scale.double().repeat_interleave(16, -1) \
            * q.scale_2.double()[:, None, None]
    assert d64.dtype == torch.float64 and torch.equal(d64, exact)
