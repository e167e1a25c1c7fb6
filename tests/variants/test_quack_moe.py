"""`experts:quack` and `experts:quack_gated` without the library. Stand-ins of quack's grouped GEMM
and gated GEMM follow their documented contracts (`gemm_tuned.fn(A, B, out, cu_seqlens_m=, A_idx=,
config=)`: B [groups, K, N] with K contiguous, rows [cu_seqlens_m[e], cu_seqlens_m[e + 1]) of `out`
use group e's B, row r reads A's row A_idx[r] when given, FP32 accumulation rounded to out's dtype;
`gemm_act(..., activation="swiglu", concat_layout=("B",))`: B's N columns are [gate; up], the output
silu(gate) * up from the FP32 accumulators) and drive the adapters, their grouping, the weight-layout
transform and experts:grouped_mm's SwiGLU and combine through the op gate. Planted faults (group
bounds one row late, gate and up swapped, a layout transform that loses a half) are rejected. The
`gpu` test runs the real kernels on the other variant's layout (their op gate: test_every_variant.py)."""

import dataclasses
import sys
import types

import pytest
import torch

from tests.variants.helpers import assert_every_config_passes, failures, prefill_workloads, with_config
from workbench import gates, registry
from workbench.points import Workload
from workbench.variants.experts import quack_gated as gated_moe
from workbench.variants.kernels import quack_moe

SMALL = Workload("beam-tiny", batch=2, tokens_per_seq=24, context=24, dtype="bf16")  # MIN_TOKENS lowered for it


def _grouped_gemm(A, B, out, *, cu_seqlens_m, A_idx=None, config):
    assert B.stride(-2) == 1 and out.is_contiguous() and config.cluster_n == 1  # K contiguous, any group stride
    assert cu_seqlens_m.dtype == torch.int32 and cu_seqlens_m.numel() == B.shape[0] + 1
    assert A_idx is None or (A_idx.dtype == torch.int32 and A_idx.numel() == out.shape[0])
    assert int(cu_seqlens_m[-1]) == out.shape[0]
    bounds = cu_seqlens_m.tolist()
    for e in range(B.shape[0]):
        rows = torch.arange(bounds[e], bounds[e + 1])
        a = A[A_idx.long()[rows]] if A_idx is not None else A[rows]
        out[rows] = (a.float() @ B[e].float()).to(out.dtype)


def _gemm_act(A, B, *, activation, cu_seqlens_m, A_idx, store_preact, concat_layout, tuned, config):
    assert (activation, store_preact, concat_layout, tuned) == ("swiglu", False, ("B",), False)
    ff = B.shape[-1] // 2
    pre = torch.empty((A_idx.numel(), 2 * ff), dtype=torch.float32)
    _grouped_gemm(A.float(), B, pre, cu_seqlens_m=cu_seqlens_m, A_idx=A_idx, config=config)
    return None, (torch.nn.functional.silu(pre[:, :ff]) * pre[:, ff:]).to(A.dtype)


@pytest.fixture
def stand_in(monkeypatch):
    """quack's modules the adapter imports, holding the stand-in; MIN_TOKENS lowered (the interpreted
    SwiGLU and combine are slow at 1024 tokens)."""
    quack = types.ModuleType("quack")
    interface = types.ModuleType("quack.gemm_interface")
    interface.gemm_tuned = types.SimpleNamespace(fn=_grouped_gemm)
    interface.gemm_act = _gemm_act
    config = types.ModuleType("quack.gemm_config")
    config.GemmConfig = lambda **kw: types.SimpleNamespace(**kw)
    for name, module in (("quack", quack), ("quack.gemm_interface", interface), ("quack.gemm_config", config)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(quack_moe, "_quack_installed", lambda: True)
    monkeypatch.setattr(quack_moe, "MIN_TOKENS", SMALL.tokens)
    monkeypatch.setattr(gated_moe, "_dsl_keyable", lambda: True)
    quack_moe.gemm_config.cache_clear()
    yield
    quack_moe.gemm_config.cache_clear()


def _on_cpu(v):
    return dataclasses.replace(v, backend="torch")  # the stand-in runs where the real kernels cannot


def _gate(v):
    return gates.op_gate(_on_cpu(v), [SMALL], device="cpu", seeds=(0,))


def test_every_config_passes_the_op_gate_through_the_stand_in(stand_in):
    assert_every_config_passes(_on_cpu(registry.get("experts", "quack")), [SMALL], device="cpu", seeds=(0,))


@pytest.mark.parametrize("name", ["quack", "quack_gated"])
def test_gate_rejects_group_bounds_one_row_late(stand_in, monkeypatch, name):
    real = quack_moe.expert_bounds

    def late(sorted_ids, n_experts):
        bounds = real(sorted_ids, n_experts)
        return torch.cat([bounds[:1], (bounds[1:-1] + 1).clamp(max=bounds[-1]), bounds[-1:]])

    monkeypatch.setattr(quack_moe, "expert_bounds", late)
    report = _gate(registry.get("experts", name))
    assert not report.passed and any(c.name == "accuracy" for c in report.failures), failures(report)


@pytest.mark.parametrize("n_experts", [16, 300])  # a uint8 and an int16 sort key
def test_sort_pairs_is_a_stable_sort_by_expert(n_experts):
    g = torch.Generator().manual_seed(0)
    ids = torch.rand(97, n_experts, generator=g).topk(4, dim=-1).indices
    ids[:5] = torch.arange(n_experts - 4, n_experts)  # the highest ids, beyond any narrower key
    cu, tokens, pos = quack_moe.sort_pairs(ids, n_experts)
    order = ids.flatten().argsort(stable=True)  # the int64 sort it replaces
    assert cu.dtype == tokens.dtype == torch.int32 and pos.dtype == torch.int64
    assert torch.equal(cu, torch.searchsorted(ids.flatten()[order], torch.arange(n_experts + 1), out_int32=True))
    assert torch.equal(tokens, (order // 4).int())
    assert torch.equal(order[pos], torch.arange(ids.numel()))


def test_gate_rejects_gate_and_up_swapped(stand_in, monkeypatch):
    from workbench.variants.kernels import moe_grouped_mm as kernels

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


# ---- experts:quack_gated

def test_gated_every_config_passes_the_op_gate_through_the_stand_in(stand_in):
    assert_every_config_passes(_on_cpu(registry.get("experts", "quack_gated")), [SMALL], device="cpu", seeds=(0,))


def _halves_swapped(w):
    return {**w, "gate_up": torch.cat([w["up_proj"], w["gate_proj"]], dim=1)}


def _up_lost(w):
    """Re-points up at gate's half: the model's up_proj no longer holds up (the variant's own gate_up
    is right): the model's weights changed."""
    out = gated_moe.gate_up_in_one(w)
    e, f, h = w["up_proj"].shape
    w["up_proj"].set_(out["gate_up"].untyped_storage(), 0, (e, f, h), out["gate_up"].stride())
    return out


@pytest.mark.parametrize("layout, check", [(_halves_swapped, "accuracy"), (_up_lost, "inputs_unchanged")])
def test_gated_gate_rejects_a_wrong_layout_transform(stand_in, layout, check):
    report = _gate(dataclasses.replace(registry.get("experts", "quack_gated"), prepare=layout))
    assert not report.passed and any(c.name == check for c in report.failures), failures(report)


def test_gate_up_in_one_holds_the_weights_once_and_keeps_their_values():
    g = torch.Generator().manual_seed(0)
    gate, up, down = (torch.randn(4, 6, 8, generator=g) for _ in range(3))
    w = {"gate_proj": torch.nn.Parameter(gate.clone(), requires_grad=False), "up_proj": up.clone(), "down_proj": down}
    old = w["gate_proj"].data_ptr()
    out = gated_moe.gate_up_in_one(w)
    assert torch.equal(w["gate_proj"], gate) and torch.equal(w["up_proj"], up)  # the model's tensors, re-pointed
    assert torch.equal(out["gate_up"], torch.cat([gate, up], dim=1)) and out["down_proj"] is down
    merged = out["gate_up"].data_ptr()
    assert {w["gate_proj"].data_ptr(), w["up_proj"].data_ptr() - 6 * 8 * 4} == {merged} != {old}
    again = gated_moe.gate_up_in_one(out)  # idempotent: the layout is found, nothing copied
    assert again["gate_up"].data_ptr() == merged and torch.equal(again["gate_up"], out["gate_up"])


def test_gate_up_in_one_on_a_model_leaves_its_outputs_unchanged():
    from beam_model.model import BeamForCausalLM

    model = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    before = model(ids)
    experts = [layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    for e in experts:
        gated_moe.gate_up_in_one({"gate_proj": e.gate_proj, "up_proj": e.up_proj, "down_proj": e.down_proj})
        assert gated_moe._halves_of_one(e.gate_proj, e.up_proj) is not None
    assert experts
    model.set_variants()  # the reference reads the strided halves
    assert torch.equal(model(ids), before)


def _on_relaid_weights(v):
    """`v` reading gate and up as experts:quack_gated's transform leaves them in the model."""
    return dataclasses.replace(v, prepare=lambda w: {k: t for k, t in gated_moe.gate_up_in_one(w).items()
                                                     if k != "gate_up"})


def test_the_other_experts_variants_read_gate_and_up_held_in_one():
    """The model keeps quack_gated's layout when a search moves on to another variant: each experts
    variant that runs here passes the op gate on gate and up as strided halves of one storage."""
    ran = []
    for name, v in registry.variants("experts").items():
        runs = [wl for wl in (SMALL, Workload("beam-tiny", batch=2, dtype="bf16")) if not v.unsupported(wl, "cpu")]
        if name.startswith("quack") or name == "torch_compile" or not runs:
            continue
        report = gates.op_gate(_on_relaid_weights(v), runs, device="cpu", seeds=(0,))
        assert report.passed, (name, failures(report))
        ran.append(name)
    assert "torch" in ran and "triton_rows" in ran, ran


def test_gated_supports_names_why_it_declines(monkeypatch):
    v = registry.get("experts", "quack_gated")
    monkeypatch.setattr(quack_moe, "_quack_installed", lambda: True)
    prefill = Workload("beam-501b-tp8", batch=8, tokens_per_seq=2048, context=2048, dtype="bf16")
    monkeypatch.setattr(gated_moe, "_dsl_keyable", lambda: False)
    assert "site-packages" in v.supports(prefill)
    monkeypatch.setattr(gated_moe, "_dsl_keyable", lambda: True)
    assert v.supports(prefill) is True
    assert "prefill sizes" in v.supports(Workload("beam-501b-tp8", batch=64))


_GPU = pytest.mark.skipif(not registry.backend_available("cute")[0] or not quack_moe._quack_installed(),
                          reason="needs quack, the CUTLASS DSL and a CUDA GPU")


@pytest.mark.gpu
@_GPU
def test_gpu_quack_reads_gate_and_up_held_in_one():
    """After experts:quack_gated's layout transform (the model keeps it when the search moves on) the
    other grouped variants read gate_proj and up_proj as strided halves."""
    report = gates.op_gate(_on_relaid_weights(registry.get("experts", "quack")), prefill_workloads("beam-501b-tp8")[1:],
                           device="cuda", seeds=(0,))
    assert report.passed, failures(report)
