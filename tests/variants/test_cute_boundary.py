"""`boundary:cute`, the CuTe DSL variant of `boundary`, against the torch reference.

(Registration, imports and `supports`: test_cute_variants.py; the op gate at every tuning config:
test_every_variant.py.) The `gpu` tests check the last site (no next norm) and the rounding element by
element, and replay the kernel in a CUDA graph with new inputs.
"""


import pytest
import torch

from beam_model.functional import residual_coefficients, rms_norm
from tests.variants.helpers import available, callables, on_gpu_unless_quarantined
from workbench import registry

on_gpu = on_gpu_unless_quarantined("boundary", "cute")


# ---- on the GPU ----------------------------------------------------------------------------------

def _ulps(out, ref):
    """Elementwise distance in units in the last place of a 16-bit float dtype."""
    def ordered(x):
        bits = x.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return (ordered(out) - ordered(ref)).abs()


def _same_rounding(out, ref, label, terms=None):
    """At most 1 ulp from the reference at the model dtype, and rarely that: the FP32 sums run in another
    order (and may fuse multiply-adds), which moves a value across a rounding boundary now and then.
    `terms`: the size of the FP32 terms an element sums (|a*h| + |b*norm(y)|). Where they nearly cancel,
    the result's own ulp is far below their FP32 rounding, and a fused multiply-add moves it many ulps
    (on the H200: 8 of 10M elements at 2048 x 5120, 48 ulps, as an FP64 emulation of the FMA gives); such
    an element may differ by at most 2^-20 of its terms, which a wrong value would not."""
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous(), label
    ulps = _ulps(out, ref)
    far = ulps > 1
    if terms is not None:
        far &= (out.double() - ref.double()).abs() > terms * 2.0 ** -20
    assert not far.any(), f"{label}: {int(far.sum())} elements > 1 ulp from the reference"
    off = int((ulps > 0).sum())
    assert off <= max(1, 0.01 * ulps.numel()), f"{label}: {off} of {ulps.numel()} elements 1 ulp off"


def _terms(y, h, w, eps=1e-6):
    """|a*h| + |b*norm(y)| per element: what boundary's FP32 sum adds before its one rounding."""
    a, b = w["residual"][0].double(), w["residual"][1].double()
    return (a * h.double()).abs() + (b * rms_norm(y, w["post_norm"], eps).double()).abs()


def _inputs(preset, n, *, last=False, seed=0):
    from beam_model.config import BeamConfig

    hidden, dev, dtype = BeamConfig.from_preset(preset).hidden_size, torch.device("cuda"), torch.bfloat16
    gen = torch.Generator().manual_seed(seed)
    y = (3 * torch.randn(n, hidden, generator=gen)).to(dev, dtype)
    h = torch.randn(n, hidden, generator=gen).to(dev, dtype)
    w = {"post_norm": (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dev, dtype),
         "next_norm": None if last else (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dev, dtype),
         "residual": torch.tensor(residual_coefficients(51), dtype=torch.float32, device=dev)}
    return y, h, w


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("last", [False, True], ids=["next-norm", "last-site"])
@pytest.mark.parametrize("preset", ["beam-tiny", "beam-501b-tp8"])
@pytest.mark.parametrize("n", [1, 8, 64, 2048])
def test_gpu_rounding(n, preset, last):
    """Both outputs rounded where the reference rounds them: h_new once, x_next from h_new as stored."""
    v, ref = available("boundary", "cute"), registry.reference("boundary")
    y, h, w = _inputs(preset, n, last=last, seed=n)
    y0, h0 = y.clone(), h.clone()
    h_ref = ref.fn(y, h, w, eps=1e-6)[0]
    for label, fn in callables(v):
        h_new, x_next = fn(y, h, w, eps=1e-6)
        _same_rounding(h_new, h_ref, f"h_new {label}", terms=_terms(y, h, w))
        if last:
            assert x_next is None
        else:  # the norm of h_new as this variant stored it (where h_new moved, x_next moves with it)
            _same_rounding(x_next, rms_norm(h_new, w["next_norm"], 1e-6).to(h.dtype), f"x_next {label}")
    assert torch.equal(y, y0) and torch.equal(h, h0), "boundary must not modify its inputs"


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("preset", ["beam-tiny", "beam-501b-tp8"])
def test_gpu_cuda_graph_replay(preset):
    """Captured once, replayed on new values written into the captured inputs: no host sync, no stale
    result, and the launch goes to torch's current stream (torch.cuda.graph captures on a side stream)."""
    v, ref = available("boundary", "cute"), registry.reference("boundary")
    y, h, w = _inputs(preset, 8, seed=1)
    for label, fn in callables(v):
        fn(y, h, w, eps=1e-6)  # compile and load outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            h_new, x_next = fn(y, h, w, eps=1e-6)
        for seed in (2, 3):
            y2, h2, _ = _inputs(preset, 8, seed=seed)
            y.copy_(y2)
            h.copy_(h2)
            graph.replay()
            torch.cuda.synchronize()
            h_ref, x_ref = ref.fn(y, h, w, eps=1e-6)
            _same_rounding(h_new, h_ref, f"graph h_new {label} seed{seed}")
            _same_rounding(x_next, x_ref, f"graph x_next {label} seed{seed}")


# ---- the rounding rule itself (CPU) ---------------------------------------------------------------

def test_rounding_rule_allows_a_fused_multiply_add_and_rejects_a_wrong_vector():
    """The H200 inputs of test_gpu_rounding at 2048 x 5120: an FP64 emulation of the kernel's fused
    multiply-add is up to 48 ulps off where the terms cancel (what the GPU showed) and must pass; the
    same output with one 16-byte vector 5% off must not."""
    from beam_model.config import BeamConfig

    hidden, n = BeamConfig.from_preset("beam-501b-tp8").hidden_size, 2048
    gen = torch.Generator().manual_seed(n)
    y = (3 * torch.randn(n, hidden, generator=gen)).to(torch.bfloat16)
    h = torch.randn(n, hidden, generator=gen).to(torch.bfloat16)
    w = {"post_norm": (1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16),
         "residual": torch.tensor(residual_coefficients(51), dtype=torch.float32)}
    a, b = w["residual"][0], w["residual"][1]
    z = rms_norm(y, w["post_norm"], 1e-6)
    ref = (a * h.float() + b * z).to(torch.bfloat16)
    fma = (a.double() * h.double() + (b * z).double()).float().to(torch.bfloat16)  # one rounding of a*h + (b*z)
    assert _ulps(fma, ref).max() > 1  # the case the rule is for
    with pytest.raises(AssertionError, match="> 1 ulp"):
        _same_rounding(fma, ref, "fma")
    _same_rounding(fma, ref, "fma", terms=_terms(y, h, w))
    wrong = fma.clone()
    wrong[7, 80:88] *= 1.05
    with pytest.raises(AssertionError, match="8 elements > 1 ulp"):
        _same_rounding(wrong, ref, "wrong", terms=_terms(y, h, w))
