"""`sample:flashinfer` without the library: a stand-in of `flashinfer.sampling.top_k_top_p_sampling_from_probs`
that follows its documented contract (FP32 probabilities, per-row top_k and top_p, top-k first, one draw
per row from `generator`) checks the adapter (temperature, greedy rows, top_k 0) through the op gate,
its statistical checks included (the real kernel's op gate: test_every_variant.py, on the GPU)."""

import dataclasses
import sys

import pytest
import torch

from tests.variants.helpers import failures, stand_in_flashinfer
from workbench import gates, registry
from workbench.points import Workload


@pytest.fixture
def calls(monkeypatch):
    seen = []

    def top_k_top_p_sampling_from_probs(probs, top_k, top_p, indices=None, filter_apply_order="top_k_first",
                                        deterministic=True, generator=None, check_nan=False):
        assert probs.dtype == torch.float32 and top_k.dtype == torch.int32 and top_p.dtype == torch.float32
        assert filter_apply_order == "top_k_first" and indices is None
        seen.append(top_k.clone())
        sorted_p, order = probs.sort(-1, descending=True)
        keep = torch.arange(probs.shape[1])[None, :] < top_k[:, None]
        p = sorted_p * keep
        p = p / p.sum(-1, keepdim=True)
        keep &= (p.cumsum(-1) - p) <= top_p[:, None]  # the smallest set whose mass reaches top_p
        choice = torch.multinomial(sorted_p * keep, 1, generator=generator)
        return order.gather(1, choice)[:, 0].to(torch.int32)

    stand_in_flashinfer(monkeypatch, "sampling", top_k_top_p_sampling_from_probs=top_k_top_p_sampling_from_probs)
    return seen


def test_adapter_passes_the_op_gate(calls):
    """Greedy rows exact, every draw inside top-k/top-p, the distribution by chi-square; top_k 0 ("off")
    reaches the kernel as the vocabulary size."""
    v = registry.get("sample", "flashinfer")
    report = gates.op_gate(dataclasses.replace(v, backend="torch"), [Workload("beam-tiny", batch=b) for b in (1, 6)],
                           device="cpu", seeds=(0, 1))
    assert report.passed, failures(report)
    vocab = Workload("beam-tiny").config.vocab_size
    assert calls and all(((k > 0) & (k <= vocab)).all() for k in calls) and any((k == vocab).any() for k in calls)


def test_a_wrong_filter_order_fails_the_gate(calls, monkeypatch):
    """The stand-in is strict enough to matter: top-p applied before top-k draws outside the support."""
    sampling = sys.modules["flashinfer.sampling"]
    right = sampling.top_k_top_p_sampling_from_probs

    def top_p_first(probs, top_k, top_p, **kw):
        sorted_p, order = probs.sort(-1, descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) <= top_p[:, None]
        keep &= torch.arange(probs.shape[1])[None, :] < top_k[:, None]
        out = torch.zeros_like(probs).scatter_(1, order, sorted_p * keep)
        return right(out / out.sum(-1, keepdim=True), torch.full_like(top_k, probs.shape[1]), torch.ones_like(top_p),
                     **kw)

    monkeypatch.setattr(sampling, "top_k_top_p_sampling_from_probs", top_p_first)
    v = registry.get("sample", "flashinfer")
    report = gates.op_gate(dataclasses.replace(v, backend="torch"), [Workload("beam-tiny", batch=6)], device="cpu",
                           seeds=(0, 1))
    assert not report.passed and report.first_failure().startswith(("support", "distribution"))

