"""`attention_out:triton_merged`: the split merge and the gate in o_proj's GEMV prologue (Triton
interpreter at beam-tiny shapes; the TP8 rank's shapes and PDL on the GPU)."""

import pytest
import torch

from workbench import registry
from workbench.gates import op_gate
from workbench.points import Workload, spec

pytestmark = pytest.mark.skipif(registry.backend_available("triton")[0] is False, reason="needs triton")

B1 = Workload(batch=1, context=1000)


def _configs():
    from workbench.variants.attention_out.triton_merged import CONFIGS
    return CONFIGS


def _merged_calls(monkeypatch) -> list:
    from workbench.variants.kernels import attention_merged_gemv as merged

    calls, run = [], merged.decode_merged
    monkeypatch.setattr(merged, "decode_merged", lambda *a, **k: calls.append(k["merged_cfg"]) or run(*a, **k))
    return calls


def test_the_op_gate_passes_through_the_merged_gemv_at_every_head_grouping(monkeypatch):
    """Batch 1 decode takes the merged GEMV (one head group, or several summed by the last to arrive:
    beam-tiny's 4 heads in groups of 4, 2 or 1), sliding and full layers. The configs left out differ
    from these only in BLOCK_N, warps and the attention config (the search gates every one)."""
    calls = _merged_calls(monkeypatch)
    workloads = [B1.with_(layer=k) for k in ("sliding", "full")]
    configs = {c["merged"]["HEADS"]: c for c in _configs()}  # 6, 3 and 1 heads a program
    assert sorted(configs) == [1, 3, 6]
    for config in configs.values():
        report = op_gate(registry.get("attention_out", "triton_merged"), workloads, seeds=(0,), config=config)
        assert report.passed, (config, report.failures)
    assert len(calls) >= 2 * len(configs) and {c["HEADS"] for c in calls} == {1, 3, 6}


def test_split_k_over_head_groups_gives_the_one_group_bits_or_within_rounding():
    """Head groups summed in a fixed order by the last to arrive: the same result on every call, close
    to one group's."""
    call = spec("attention_out").make_inputs(B1.with_(layer="full"), "cpu", 5)
    one, *groups = [c for c in _configs() if c["attention"] is _configs()[0]["attention"]]
    fn = registry.get("attention_out", "triton_merged")
    y_one = fn.at(one)(*call.args, **call.kwargs)
    for config in groups:
        first = fn.at(config)(*call.args, **call.kwargs)
        assert torch.equal(first, fn.at(config)(*call.args, **call.kwargs))  # the counters were reset
        torch.testing.assert_close(first.float(), y_one.float(), rtol=2e-2, atol=2e-2)


def test_more_splits_or_tokens_than_the_config_allows_take_three_launches(monkeypatch):
    """Past max_splits (a long full-attention context) or max_tokens (batch > 1), and at prefill, the
    variant runs attention_out:triton, and still passes the gate."""
    calls = _merged_calls(monkeypatch)
    config = dict(_configs()[0], max_splits=1)
    wls = [B1.with_(layer="full"), Workload(batch=2, context=1000), Workload(batch=2, tokens_per_seq=20, context=100)]
    report = op_gate(registry.get("attention_out", "triton_merged"), wls, seeds=(0,), config=config)
    assert report.passed, report.failures
    assert calls == []
    report = op_gate(registry.get("attention_out", "triton_merged"), wls[1:], seeds=(0,), config=_configs()[0])
    assert report.passed and calls == []


def test_a_config_that_would_merge_too_many_splits_in_one_program_is_refused():
    """A hand-made config past the one-tile merge's limit fails with the reason, not a spilling kernel."""
    from workbench.variants.kernels.attention_merged_gemv import MAX_SPLITS

    config = _configs()[0]
    config = dict(config, max_splits=10 ** 6, attention=dict(config["attention"], BLOCK_N=16, WAVES=100, MIN_BLOCKS=1))
    call = spec("attention_out").make_inputs(B1.with_(layer="full", context=2000), "cpu", 0)
    with pytest.raises(ValueError, match=f"merges at most {MAX_SPLITS} splits"):
        registry.get("attention_out", "triton_merged").at(config)(*call.args, **call.kwargs)


# ---- on the GPU: the TP8 rank's shapes, PDL (a CUDA graph: test_attention_out.py) ---------------------

@pytest.mark.gpu
@pytest.mark.parametrize("layer, context", [("sliding", 4096), ("full", 4096), ("full", 32768)])
def test_gpu_tp8_repeatable(layer, context):
    wl = Workload(preset="beam-501b-tp8", batch=1, context=context, layer=layer)
    call = spec("attention_out").make_inputs(wl, "cuda", 0)
    fn = registry.get("attention_out", "triton_merged")
    for config in _configs() + [dict(c, pdl=True) for c in _configs()]:
        y = fn.at(config)(*call.args, **call.kwargs)
        for _ in range(3):  # the head groups' counters reset themselves
            assert torch.equal(y, fn.at(config)(*call.args, **call.kwargs)), config

