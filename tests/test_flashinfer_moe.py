"""`experts:flashinfer` without the library: a stand-in of `flashinfer.fused_moe.cute_dsl_fused_moe_bf16`
that follows its documented contract (w1 [E, 2 x ff, hidden] with up and gate interleaved in 32-row
blocks, up first; int32 ids, FP32 scales; SwiGLU from FP32 accumulators rounded to the model dtype;
unscaled down rows rounded, then an FP32 combine rounded once) drives the adapter through the op gate,
and a planted adapter that packs gate first is rejected. The `gpu` test runs the real kernels."""

import dataclasses
import types

import pytest
import torch
import torch.nn.functional as F

from tests.variant_helpers import assert_every_config_passes, failures, stand_in_flashinfer
from workbench import gates, registry
from workbench.points import Workload
from workbench.variants import experts__flashinfer as fi_moe

PREFILL = Workload("beam-tiny", batch=2, tokens_per_seq=512, context=512, dtype="bf16")


def _cute_dsl_fused_moe_bf16(x, ids, scales, w1, w2, num_experts, top_k, use_fused_finalize=True,
                             enable_pdl=True, tactic=None, **_):
    assert ids.dtype == torch.int32 and scales.dtype == torch.float32 and x.dtype == w1.dtype == w2.dtype
    assert not use_fused_finalize and tactic is not None and len(tactic) == 3
    e, two_ff, h = w1.shape
    blocks = w1.view(e, two_ff // 64, 2, 32, h)
    up, gate = (blocks[:, :, i].reshape(e, two_ff // 2, h) for i in (0, 1))
    ids = ids.long()
    xf = x.float()[:, None, None, :]  # [N, 1, 1, h] against each pair's [ff, h] weights
    g, u = ((xf * w[ids].float()).sum(-1) for w in (gate, up))  # FP32 accumulators [N, K, ff]
    a = (F.silu(g) * u).to(x.dtype).float()
    y = (a[:, :, None, :] * w2[ids].float()).sum(-1).to(x.dtype)  # each pair's unscaled row, rounded
    out = (scales[..., None] * y.float()).sum(1)
    return out.to(x.dtype)


@pytest.fixture
def stand_in(monkeypatch):
    stand_in_flashinfer(monkeypatch, "fused_moe", cute_dsl_fused_moe_bf16=_cute_dsl_fused_moe_bf16)
    monkeypatch.setattr(fi_moe, "_cutlass_installed", lambda: True)


def _on_cpu(v):
    return dataclasses.replace(v, backend="torch")  # the stand-in runs where the real kernels cannot


def test_interleave_puts_each_up_block_before_its_gate_block():
    gate = torch.arange(2 * 64 * 3).view(2, 64, 3)
    up = -gate
    w1 = fi_moe.interleave_up_gate(gate, up)
    assert w1.shape == (2, 128, 3)
    assert torch.equal(w1[:, 0:32], up[:, 0:32]) and torch.equal(w1[:, 32:64], gate[:, 0:32])
    assert torch.equal(w1[:, 64:96], up[:, 32:64]) and torch.equal(w1[:, 96:128], gate[:, 32:64])
    with pytest.raises(ValueError, match="multiple of 32"):
        fi_moe.interleave_up_gate(gate[:, :48], up[:, :48])


def test_every_config_passes_the_op_gate_through_the_stand_in(stand_in):
    assert_every_config_passes(_on_cpu(registry.get("experts", "flashinfer")), [PREFILL], device="cpu", seeds=(0,))


def test_gate_rejects_gate_and_up_packed_the_wrong_way_round(stand_in, monkeypatch):
    real = fi_moe.interleave_up_gate
    monkeypatch.setattr(fi_moe, "interleave_up_gate", lambda gate, up: real(up, gate))
    report = gates.op_gate(_on_cpu(registry.get("experts", "flashinfer")), [PREFILL], device="cpu", seeds=(0,))
    assert not report.passed and any(c.name == "accuracy" for c in report.failures), failures(report)


def test_configs_are_flashinfer_tactics():
    assert fi_moe.tactic(**fi_moe.CONFIGS[0]) == (128, ((128, 64), 1), ((128, 64), (1, 1), False))
    for cfg in fi_moe.CONFIGS:
        tile, (g1, _), (g2, cluster, _) = fi_moe.tactic(**cfg)
        assert g1[0] == g2[0] == tile and cluster[0] == 1  # both GEMMs' M tile is moe_sort's


def test_supports_names_why_it_declines(monkeypatch):
    v = registry.get("experts", "flashinfer")
    monkeypatch.setattr(fi_moe, "_cutlass_installed", lambda: False)
    assert "CUTLASS DSL" in v.supports(PREFILL)
    monkeypatch.setattr(fi_moe, "_cutlass_installed", lambda: True)
    assert v.supports(PREFILL) is True
    assert "prefill sizes" in v.supports(Workload("beam-501b-tp8", batch=64))
    assert "bf16 or fp16" in v.supports(PREFILL.with_(dtype="fp32"))
    odd = dataclasses.replace(PREFILL.config, moe_intermediate_size=48)
    assert "multiple of 32" in v.supports(types.SimpleNamespace(config=odd, dtype="bf16", tokens=4096))


@pytest.mark.gpu
@pytest.mark.skipif(not registry.backend_available("flashinfer")[0] or not fi_moe._cutlass_installed(),
                    reason="needs flashinfer, the CUTLASS DSL and a CUDA GPU")
@pytest.mark.parametrize("preset", ["beam-tiny", "beam-501b-tp8"])
def test_gpu_every_config_passes_the_op_gate(preset):
    workloads = [Workload(preset, batch=2, tokens_per_seq=512, context=512),
                 Workload(preset, batch=1, tokens_per_seq=2048, context=2048)]
    assert_every_config_passes(registry.get("experts", "flashinfer"), workloads, device="cuda", seeds=(0, 1))
