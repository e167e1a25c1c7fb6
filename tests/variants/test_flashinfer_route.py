"""`route:flashinfer` without the library: a stand-in of `fused_topk_deepseek` that follows its
documented contract (FP32 in, int32 ids and FP32 weights written in place, launch_with_pdl flag)
checks the adapter: argument order, the FP32 router GEMM, int64 ids, and the supports limits. The
op gate with the real kernel: test_every_variant.py, on the GPU."""


import pytest
import torch

from tests.variants.helpers import stand_in_flashinfer, with_config
from workbench import registry
from workbench.points import Workload, spec


def _stand_in(scores, bias, n_group, topk_group, topk, routed_scaling_factor, topk_values, topk_indices,
              launch_with_pdl=True, routing_replay_out=None):
    assert scores.dtype == torch.float32 and bias.dtype == torch.float32 and scores.is_contiguous()
    assert topk_values.dtype == torch.float32 and topk_indices.dtype == torch.int32
    s = torch.sigmoid(scores)
    biased = s + bias
    n, e = biased.shape
    groups = biased.view(n, n_group, -1).topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices
    keep = torch.zeros(n, n_group, dtype=torch.bool).scatter_(1, groups, True).repeat_interleave(e // n_group, 1)
    ids = biased.masked_fill(~keep, float("-inf")).topk(topk, dim=-1).indices
    picked = s.gather(1, ids)
    topk_values.copy_(picked / picked.sum(-1, keepdim=True) * routed_scaling_factor)
    topk_indices.copy_(ids)


@pytest.fixture
def stand_in(monkeypatch):
    stand_in_flashinfer(monkeypatch, "fused_moe", fused_topk_deepseek=_stand_in)


@pytest.mark.parametrize("batch", [1, 7])
def test_adapter_matches_the_reference(stand_in, batch):
    wl = Workload("beam-tiny", batch=batch, dtype="bf16")
    call = spec("route").make_inputs(wl, "cpu", 0)
    ids, weights = registry.get("route", "flashinfer").fn(*call.args, **call.kwargs)
    ref_ids, ref_weights = registry.reference("route").fn(*call.args, **call.kwargs)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
    order = ids.argsort(-1), ref_ids.argsort(-1)
    assert torch.allclose(weights.gather(1, order[0]), ref_weights.gather(1, order[1]))


def test_supports_names_the_kernel_limits():
    v = registry.get("route", "flashinfer")
    assert v.supports(Workload("beam-501b-tp8")) is True and v.supports(Workload("beam-tiny")) is True
    tiny = Workload("beam-tiny", dtype="bf16")
    for changes, words in ((dict(num_experts_per_tok=9, topk_group=4), "at most 8"),
                           (dict(n_routed_experts=512, n_group=8), "32 experts per group")):
        verdict = v.supports(with_config(tiny, **changes))
        assert isinstance(verdict, str) and words in verdict

