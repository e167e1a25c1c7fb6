"""`qkvg_proj:packed_views` returns q, k, v and g as column views of one [N, q+k+v+gate] GEMM result.
Its op gate (test_every_variant.py) checks the values; these check that every consumer of those outputs (each variant of
qk_prep and attn_out that can run here) reads such views right: the same outputs (and, for qk_prep,
the same K/V cache) as from contiguous copies, with NaN in the columns between the views so that a
kernel that assumes contiguous rows reads NaN. torch_compile compiles the reference (covered here) and
is left out: a compile per variant is too slow for the CPU suite.
"""

import pytest
import torch

from workbench import registry
from workbench.points import Workload, spec
from workbench.registry import get

WORKLOADS = [Workload("beam-tiny", batch=4),  # decode rows: the GEMV paths of attn_out's variants
             Workload("beam-tiny", batch=2, tokens_per_seq=16, context=16)]  # a prompt's rows
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]
VIEWED_ARGS = {"qk_prep": (0, 1, 2), "attn_out": (1,)}  # q, k, v / g: what qkvg_proj returns


def _as_views(tensors):
    """Each [N, width] tensor as a column view of one buffer, with a NaN column before each."""
    n = tensors[0].shape[0]
    gap = torch.full((n, 1), float("nan"), dtype=tensors[0].dtype, device=tensors[0].device)
    buf = torch.cat([part for t in tensors for part in (gap, t)] + [gap], dim=1)
    views, at = [], 0
    for t in tensors:
        views.append(buf[:, at + 1:at + 1 + t.shape[1]])
        at += 1 + t.shape[1]
    return views


def _consumers():
    for point in VIEWED_ARGS:
        for name, v in registry.variants(point).items():
            if name != "torch_compile":
                yield pytest.param(point, name, id=f"{point}:{name}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("wl", WORKLOADS, ids=lambda wl: wl.label())
@pytest.mark.parametrize("point,name", list(_consumers()))
def test_consumer_reads_row_strided_views(point, name, wl, device):
    v = get(point, name)
    ok, why = registry.backend_available(v.backend)
    if not ok:
        pytest.skip(why)
    if v.unsupported(wl, device):
        pytest.skip(v.unsupported(wl, device))
    outputs = []
    for viewed in (False, True):
        call = spec(point).make_inputs(wl, device, 0)  # the same values each time (seeded): a fresh cache too
        args = list(call.args)
        if viewed:
            picked = VIEWED_ARGS[point]
            for i, view in zip(picked, _as_views([args[i] for i in picked])):
                assert not view.is_contiguous() and torch.equal(view, args[i])
                args[i] = view
        w = v.prepare_weights(args[call.weights_arg])
        args[call.weights_arg] = w
        out = v.fn(*args, **call.kwargs)
        outputs.append((out, call.kwargs.get("cache")))
    (contiguous, cache0), (viewed, cache1) = outputs
    torch.testing.assert_close(viewed, contiguous, rtol=0, atol=0, equal_nan=False)
    if cache0 is not None:
        torch.testing.assert_close(cache1, cache0, rtol=0, atol=0)


def test_packed_views_are_views_of_one_result():
    v = get("qkvg_proj", "packed_views")
    call = spec("qkvg_proj").make_inputs(WORKLOADS[1], "cpu", 0)
    x, w = call.args
    q, k, v_, g = v.fn(x, v.prepare_weights(w))
    assert q.untyped_storage().data_ptr() == g.untyped_storage().data_ptr() and not q.is_contiguous()
    for got, ref in zip((q, k, v_, g), registry.reference("qkvg_proj").fn(x, w)):
        torch.testing.assert_close(got, ref)


def test_a_reader_that_assumes_contiguous_rows_meets_nan():
    """What makes the consumer test able to fail: rows read back to back run into the NaN columns."""
    (view,) = _as_views([torch.randn(4, 8)])
    assert torch.isnan(torch.as_strided(view, view.shape, (view.shape[1], 1))).any()
