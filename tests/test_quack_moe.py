"""`experts:quack` without the library. A stand-in of quack's grouped GEMM follows its documented
contract (`gemm_tuned.fn(A, B, out, cu_seqlens_m=, A_idx=, config=)`: B [groups, K, N] with K
contiguous, rows [cu_seqlens_m[e], cu_seqlens_m[e + 1]) of `out` use group e's B, row r reads A's row
A_idx[r] when given, FP32 accumulation rounded to out's dtype) and drives the adapter, its grouping
and experts:grouped_mm's SwiGLU and combine through the op gate. Planted faults (group bounds one
row late, gate and up swapped) are rejected. The `gpu` test runs the real kernels."""

import dataclasses
import sys
import types

import pytest
import torch

from tests.variant_helpers import assert_every_config_passes, failures, prefill_workloads, with_config
from workbench import gates, registry
from workbench.points import Workload
from workbench.variants import experts__quack as quack_moe

SMALL = Workload("beam-tiny", batch=2, tokens_per_seq=24, context=24, dtype="bf16")  # MIN_TOKENS lowered for it


def _grouped_gemm(A, B, out, *, cu_seqlens_m, A_idx=None, config):
    assert B.mT.is_contiguous() and out.is_contiguous() and config.cluster_n == 1
    assert cu_seqlens_m.dtype == torch.int32 and cu_seqlens_m.numel() == B.shape[0] + 1
    assert A_idx is None or (A_idx.dtype == torch.int32 and A_idx.numel() == out.shape[0])
    assert int(cu_seqlens_m[-1]) == out.shape[0]
    bounds = cu_seqlens_m.tolist()
    for e in range(B.shape[0]):
        rows = torch.arange(bounds[e], bounds[e + 1])
        a = A[A_idx.long()[rows]] if A_idx is not None else A[rows]
        out[rows] = (a.float() @ B[e].float()).to(out.dtype)


@pytest.fixture
def stand_in(monkeypatch):
    """quack's modules the adapter imports, holding the stand-in; MIN_TOKENS lowered (the interpreted
    SwiGLU and combine are slow at 1024 tokens)."""
    quack = types.ModuleType("quack")
    interface = types.ModuleType("quack.gemm_interface")
    interface.gemm_tuned = types.SimpleNamespace(fn=_grouped_gemm)
    config = types.ModuleType("quack.gemm_config")
    config.GemmConfig = lambda **kw: types.SimpleNamespace(**kw)
    for name, module in (("quack", quack), ("quack.gemm_interface", interface), ("quack.gemm_config", config)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(quack_moe, "_quack_installed", lambda: True)
    monkeypatch.setattr(quack_moe, "MIN_TOKENS", SMALL.tokens)
    quack_moe._gemm_config.cache_clear()
    yield
    quack_moe._gemm_config.cache_clear()


def _on_cpu(v):
    return dataclasses.replace(v, backend="torch")  # the stand-in runs where the real kernels cannot


def _gate(v):
    return gates.op_gate(_on_cpu(v), [SMALL], device="cpu", seeds=(0,))


def test_every_config_passes_the_op_gate_through_the_stand_in(stand_in):
    assert_every_config_passes(_on_cpu(registry.get("experts", "quack")), [SMALL], device="cpu", seeds=(0,))


def test_gate_rejects_group_bounds_one_row_late(stand_in, monkeypatch):
    real = quack_moe.expert_bounds

    def late(sorted_ids, n_experts):
        bounds = real(sorted_ids, n_experts)
        return torch.cat([bounds[:1], (bounds[1:-1] + 1).clamp(max=bounds[-1]), bounds[-1:]])

    monkeypatch.setattr(quack_moe, "expert_bounds", late)
    report = _gate(registry.get("experts", "quack"))
    assert not report.passed and any(c.name == "accuracy" for c in report.failures), failures(report)


def test_gate_rejects_gate_and_up_swapped(stand_in, monkeypatch):
    from workbench.variants import _triton_moe_grouped_mm as kernels

    real = kernels.swiglu
    monkeypatch.setattr(kernels, "swiglu", lambda g, u: real(u, g))
    report = _gate(registry.get("experts", "quack"))
    assert not report.passed and any(c.name == "accuracy" for c in report.failures), failures(report)


def test_supports_names_why_it_declines(monkeypatch):
    v = registry.get("experts", "quack")
    monkeypatch.setattr(quack_moe, "_quack_installed", lambda: False)
    assert "quack-kernels" in v.supports(SMALL)
    monkeypatch.setattr(quack_moe, "_quack_installed", lambda: True)
    prefill = Workload("beam-501b-tp8", batch=8, tokens_per_seq=2048, context=2048, dtype="bf16")
    assert v.supports(prefill) is True
    assert "prefill sizes" in v.supports(Workload("beam-501b-tp8", batch=64))
    assert "bf16 or fp16" in v.supports(prefill.with_(dtype="fp32"))
    odd = with_config(prefill, moe_intermediate_size=36)
    assert "multiples of 8" in v.supports(odd)


@pytest.mark.gpu
@pytest.mark.skipif(not registry.backend_available("cute")[0] or not quack_moe._quack_installed(),
                    reason="needs quack, the CUTLASS DSL and a CUDA GPU")
@pytest.mark.parametrize("preset", ["beam-tiny", "beam-501b-tp8"])
def test_gpu_every_config_passes_the_op_gate(preset):
    assert_every_config_passes(registry.get("experts", "quack"), prefill_workloads(preset), device="cuda", seeds=(0, 1))
