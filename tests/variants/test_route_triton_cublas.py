"""`route:triton_cublas` against the reference and under the op gate.

CPU: the GEMMs run as FP32 matmuls of the same exact BF16 products (no out_dtype kernels on the CPU) and
the selection kernel under the Triton interpreter, so these check the plumbing: the pieces, their order,
the chain's running sum, the split's and the batched GEMM's partials and the hand-over to route:triton
at small sizes. (The op gate, every config, on the CPU and with cuBLAS on the GPU: test_every_variant.py.)
"""

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from tests.variants.helpers import failures  # noqa: E402
from tests.variants.test_triton_route_head_sample import _assert_routes_equal, _route_case  # noqa: E402
from workbench import gates  # noqa: E402
from workbench.points import Workload  # noqa: E402
from workbench.registry import get, reference  # noqa: E402
from workbench.variants.route import triton_cublas as mod  # noqa: E402


@pytest.mark.parametrize("config", mod.CONFIGS, ids=str)
@pytest.mark.parametrize("n", [5, 100])  # route:triton's GEMV (5), the cuBLAS GEMMs (100)
@pytest.mark.parametrize("shape", ["tiny", "e256", "long"])
def test_matches_reference(shape, n, config):
    x, w, kw = _route_case(shape, n, seed=n)
    v = get("route", "triton_cublas")
    _assert_routes_equal(v.at(config)(x, v.prepare_weights(w), **kw), reference("route").fn(x, w, **kw))


def test_other_activation_dtypes_take_route_triton():
    """FP32 activations are not exact in one BF16 piece: route:triton's regimes split them too."""
    x, w, kw = _route_case("e256", 100, torch.float32, seed=4)
    v = get("route", "triton_cublas")
    _assert_routes_equal(v.fn(x, v.prepare_weights(w), **kw), reference("route").fn(x, w, **kw))


PREFILL = Workload("beam-tiny", batch=1, tokens_per_seq=128, context=128)  # 128 tokens: the GEMMs


def test_op_gate_rejects_a_chain_that_drops_its_running_sum(monkeypatch):
    """Planted fault: an epilogue that overwrites instead of adding keeps only x @ w1 (W to 8 bits)."""
    real = mod._mm_f32
    monkeypatch.setattr(mod, "_mm_f32", lambda x, w, *, acc=None, out=None: real(x, w, out=out))
    report = gates.op_gate(get("route", "triton_cublas"), [PREFILL], seeds=(0,))
    assert not report.passed
    assert {c.name for c in report.failures} & {"route_ids", "route_weights"}, failures(report)


def test_op_gate_rejects_batched_partials_that_lose_a_piece(monkeypatch):
    """Planted fault: a batched GEMM that keeps only x @ w1 (W to 8 bits), the others zeroed."""
    real = mod._bmm_f32
    monkeypatch.setattr(mod, "_bmm_f32", lambda x, pieces: real(x, pieces) * torch.tensor([1.0, 0, 0])[:, None, None])
    batched = next(c for c in mod.CONFIGS if c["gemms"] == "batched")
    report = gates.op_gate(get("route", "triton_cublas"), [PREFILL], seeds=(0,), config=batched)
    assert not report.passed
    assert {c.name for c in report.failures} & {"route_ids", "route_weights"}, failures(report)


def test_supports_and_config_supports_say_why():
    v = get("route", "triton_cublas")
    assert v.supports(PREFILL) is True
    assert "BF16 activations" in v.supports(dataclasses.replace(PREFILL, dtype="fp16"))
    decode = Workload("beam-tiny", batch=8)
    assert v.unsupported_config(mod.CONFIGS[0], decode) is None
    assert "timed once" in v.unsupported_config(mod.CONFIGS[1], decode)
    assert v.unsupported_config(mod.CONFIGS[1], PREFILL) is None

