"""`qkvg_proj:flashinfer` and `attn_out:flashinfer` without the library: a stand-in of
`flashinfer.gemm.tinygemm_bf16` that follows its documented contract (BF16, contiguous, input features
a multiple of 64, output features of 16, `out` written in place, FP32 accumulation) checks the adapters
through the op gate (the real kernel's: test_every_variant.py, on the GPU)."""

import dataclasses
import types

import pytest
import torch
import torch.nn.functional as F

from tests.variants.helpers import failures, stand_in_flashinfer
from workbench import gates, registry
from workbench.points import Workload

POINTS = ("qkvg_proj", "attn_out")


@pytest.fixture
def calls(monkeypatch):
    seen = []

    def tinygemm_bf16(input, weight, out, bias=None, use_pdl=False):
        for t in (input, weight, out):
            assert t.dtype == torch.bfloat16 and t.is_contiguous()
        assert input.shape[1] % 64 == 0 and weight.shape[0] % 16 == 0 and bias is None
        assert out.shape == (input.shape[0], weight.shape[0])
        seen.append((input.shape[0], use_pdl))
        out.copy_(F.linear(input.float(), weight.float()))  # FP32 accumulation, one rounding

    stand_in_flashinfer(monkeypatch, "gemm", tinygemm_bf16=tinygemm_bf16)
    return seen


def _gate(point, workloads, device, config=None):
    v = registry.get(point, "flashinfer")
    return gates.op_gate(dataclasses.replace(v, backend="torch"), workloads, device=device, seeds=(0,),
                         config=config)


@pytest.mark.parametrize("config", [None, {"pdl": True}])
@pytest.mark.parametrize("point", POINTS)
def test_adapter_passes_the_op_gate(calls, point, config):
    """Decode rows go through tinygemm_bf16, a prompt's rows through cuBLAS; both pass the gate. A "pdl"
    config launches tinygemm_bf16 with use_pdl, the default without."""
    report = _gate(point, [Workload("beam-tiny", batch=b, dtype="bf16") for b in (1, 3, 16)]
                   + [Workload("beam-tiny", batch=2, tokens_per_seq=24, context=24, dtype="bf16")], "cpu", config)
    assert report.passed, failures(report)
    assert set(calls) == {(b, bool(config)) for b in (1, 3, 16)}  # never the 48 prompt rows


@pytest.mark.parametrize("point", POINTS)
def test_supports_names_the_kernel_limits(point):
    v = registry.get(point, "flashinfer")
    assert v.supports(Workload("beam-501b-tp8", dtype="bf16")) is True
    assert "bf16" in v.supports(Workload("beam-tiny", dtype="fp16"))
    odd = dataclasses.replace(Workload("beam-tiny").config, hidden_size=72, head_dim=24)
    verdict = v.supports(types.SimpleNamespace(config=odd, dtype="bf16"))
    assert isinstance(verdict, str) and "multiple of" in verdict

