"""Triton variants of `boundary`, `qk_prep` and `attn_out` against their torch references.

On the CPU these run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET), so the
shapes are tiny; the `gpu` test compiles them at beam-501b-tp8 shapes and also replays them in a
CUDA graph. Every tuning config a variant offers the harness is checked, since each one is a
separately compiled kernel. Errors are max |out - ref| / max |ref|; BF16 outputs must also agree
with the reference's rounding element by element (at most 1 ulp apart, and rarely that).
"""

import pytest
import torch

from beam_model.functional import residual_coefficients
from tests.variants.helpers import available, callables
from workbench import registry
from workbench.variants.kernels import output_gate

BIG_POSITION = 1_000_000  # RoPE angles this large are where FP32 angle math breaks


def _rel(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _ulps(out, ref):
    """Elementwise distance in units in the last place of a 16-bit float dtype."""
    def ordered(x):
        bits = x.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return (ordered(out) - ordered(ref)).abs()


def _check(out, ref, dtype, *, fp32_tol=2e-6, max_one_ulp=0.01, label=""):
    assert out.shape == ref.shape and out.dtype == ref.dtype, label
    if dtype == torch.float32:
        assert _rel(out, ref) <= fp32_tol, f"{label}: rel err {_rel(out, ref):.2e}"
    else:
        ulps = _ulps(out, ref)
        assert ulps.max() <= 1, f"{label}: {int((ulps > 1).sum())} elements > 1 ulp from the reference"
        assert (ulps > 0).float().mean() <= max_one_ulp, f"{label}: {int((ulps > 0).sum())} elements 1 ulp off"


DTYPES = [torch.float32, torch.bfloat16]


# ---- boundary ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,hidden,last", [(1, 64, False), (5, 48, False), (5, 64, True)])
def test_boundary(n, hidden, last, dtype):
    v, ref = available("boundary", "triton"), registry.reference("boundary")
    gen = torch.Generator().manual_seed(n * hidden)
    y = (3 * torch.randn(n, hidden, generator=gen)).to(dtype)
    h = torch.randn(n, hidden, generator=gen).to(dtype)
    w = {"post_norm": (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype),
         "next_norm": None if last else (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype),
         "residual": torch.tensor(residual_coefficients(7), dtype=torch.float32)}
    y0, h0 = y.clone(), h.clone()
    h_ref, x_ref = ref.fn(y, h, w, eps=1e-6)
    for label, fn in callables(v):
        h_new, x_next = fn(y, h, w, eps=1e-6)
        _check(h_new, h_ref, dtype, label=f"h_new {label}")
        if last:
            assert x_next is None
        else:
            _check(x_next, x_ref, dtype, label=f"x_next {label}")
    assert torch.equal(y, y0) and torch.equal(h, h0), "boundary must not modify its inputs"


# ---- qk_prep -------------------------------------------------------------------------------------

def _qk_inputs(n, heads, kv_heads, hd, dtype, gen):
    pages, page_size = 2 * n + 2, 4
    q = torch.randn(n, heads * hd, generator=gen).to(dtype)
    k = torch.randn(n, kv_heads * hd, generator=gen).to(dtype)
    v = torch.randn(n, kv_heads * hd, generator=gen).to(dtype)
    w = {"q_norm": (1 + 0.1 * torch.randn(hd, generator=gen)).to(dtype),
         "k_norm": (1 + 0.1 * torch.randn(hd, generator=gen)).to(dtype)}
    cache = torch.full((pages, 2, page_size, kv_heads, hd), float("nan"), dtype=dtype)
    slots = torch.randperm(pages * page_size, generator=gen)[:n]  # scattered, distinct
    positions = torch.tensor([BIG_POSITION, 0, 7, BIG_POSITION - 3, 4095, 123_457][:n], dtype=torch.int64)
    return q, k, v, w, cache, slots, positions


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("layer", ["sliding", "full"])
@pytest.mark.parametrize("n,heads,kv_heads,hd", [(1, 4, 2, 16), (5, 3, 1, 8)])
def test_qk_prep(n, heads, kv_heads, hd, layer, dtype):
    v, ref = available("qk_prep", "triton"), registry.reference("qk_prep")
    gen = torch.Generator().manual_seed(n + heads + hd)
    q, k, val, w, cache, slots, positions = _qk_inputs(n, heads, kv_heads, hd, dtype, gen)
    kw = dict(slot_mapping=slots, positions=positions, eps=1e-6,
              rope_theta=10000.0 if layer == "sliding" else None,
              ssmax=None if layer == "sliding" else (2048.0, 0.1))
    cache_ref = cache.clone()
    q_ref = ref.fn(q, k, val, w, cache=cache_ref, **kw)
    written = ~cache_ref.isnan()
    for label, fn in callables(v):
        out_cache = cache.clone()
        q_out = fn(q, k, val, w, cache=out_cache, **kw)
        _check(q_out, q_ref, dtype, label=f"q_out {label}")
        assert torch.equal(~out_cache.isnan(), written), f"{label}: wrote other cache slots than the reference"
        _check(out_cache[:, 0][written[:, 0]], cache_ref[:, 0][written[:, 0]], dtype, label=f"K {label}")
        assert torch.equal(out_cache[:, 1][written[:, 1]], cache_ref[:, 1][written[:, 1]]), f"V {label}"


def test_qk_prep_rope_at_large_positions():
    """FP32 angles would be off by up to ~0.03 rad near 1M; the kernel must track the FP64 reference."""
    v, ref = available("qk_prep", "triton"), registry.reference("qk_prep")
    gen = torch.Generator().manual_seed(1)
    n, heads, hd = 4, 2, 32
    q, k, val, w, cache, slots, _ = _qk_inputs(n, heads, 1, hd, torch.float32, gen)
    positions = torch.tensor([1_048_575, 999_983, 786_431, 524_289], dtype=torch.int64)
    kw = dict(slot_mapping=slots, positions=positions, eps=1e-6, rope_theta=10000.0, ssmax=None)
    q_ref = ref.fn(q, k, val, w, cache=cache.clone(), **kw)
    assert _rel(v.fn(q, k, val, w, cache=cache.clone(), **kw), q_ref) <= 2e-6


# ---- attn_out ------------------------------------------------------------------------------------

def _attn_inputs(n, heads, hd, hidden, dtype, gen):
    o = torch.randn(n, heads, hd, generator=gen).to(dtype)
    g = (2 * torch.randn(n, heads * hd, generator=gen)).to(dtype)
    w = {"gate_bias": torch.randn(heads, generator=gen).to(dtype),
         "o_proj": (torch.randn(hidden, heads * hd, generator=gen) / (heads * hd) ** 0.5).to(dtype)}
    return o, g, w


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["triton", "triton_fused", "triton_gemv", "triton_gemv_gated"])
@pytest.mark.parametrize("n,heads,hd,hidden", [(1, 4, 16, 48), (5, 3, 8, 40), (20, 2, 8, 16)])
def test_attn_out(n, heads, hd, hidden, name, dtype):
    v, ref = available("attn_out", name), registry.reference("attn_out")
    o, g, w = _attn_inputs(n, heads, hd, hidden, dtype, torch.Generator().manual_seed(n * heads))
    y_ref = ref.fn(o, g, w)
    for label, fn in callables(v):
        y = fn(o, g, w)
        assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
        # The GEMM sums in another order than the reference's: FP32 rounding noise, BF16 output ulps.
        assert _rel(y, y_ref) <= (1e-5 if dtype == torch.float32 else 2 ** -8), f"{name} {label}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_attn_gate_rounding(dtype):
    """The gated activations (before o_proj) match the reference's single rounding."""
    available("attn_out", "triton")
    n, heads, hd = 5, 3, 16
    o, g, w = _attn_inputs(n, heads, hd, 8, dtype, torch.Generator().manual_seed(3))
    gate = torch.sigmoid(g.float().view(n, heads, hd) + w["gate_bias"].float()[None, :, None])
    ref = (o.float() * gate).to(dtype).reshape(n, heads * hd)
    for cfg in output_gate.GATE_CONFIGS:
        _check(output_gate.output_gate(o, g, w["gate_bias"], **cfg), ref, dtype, label=str(cfg))


# ---- on the GPU: compiled, at beam-501b-tp8 shapes, and inside a CUDA graph -----------------------

def _graph_replay(fn):
    """Capture fn() in a CUDA graph and replay it; returns the graph's outputs (fails on host syncs)."""
    fn()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_gpu_tp8_shapes(batch):
    from beam_model.config import BeamConfig

    c = BeamConfig.from_preset("beam-501b-tp8")
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (5120, 6, 1, 128)
    dev, dtype, eps = torch.device("cuda"), torch.bfloat16, c.rms_norm_eps
    gen = torch.Generator().manual_seed(batch)
    hidden, heads, hd = c.hidden_size, c.num_attention_heads, c.head_dim

    y = (3 * torch.randn(batch, hidden, generator=gen)).to(dev, dtype)
    h = torch.randn(batch, hidden, generator=gen).to(dev, dtype)
    bw = {"post_norm": (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dev, dtype),
          "next_norm": (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dev, dtype),
          "residual": torch.tensor(residual_coefficients(51), dtype=torch.float32, device=dev)}
    h_ref, x_ref = registry.reference("boundary").fn(y, h, bw, eps=eps)
    for label, fn in callables(available("boundary", "triton")):
        h_new, x_next = _graph_replay(lambda: fn(y, h, bw, eps=eps))
        _check(h_new, h_ref, dtype, label=f"boundary h_new {label}")
        _check(x_next, x_ref, dtype, label=f"boundary x_next {label}")

    q, k, val, qw, cache, slots, _ = _qk_inputs(batch, heads, 1, hd, dtype, gen)
    q, k, val, cache, slots = (t.to(dev) for t in (q, k, val, cache, slots))
    qw = {key: t.to(dev) for key, t in qw.items()}
    positions = torch.randint(0, BIG_POSITION, (batch,), generator=gen).to(dev)
    for layer in ("sliding", "full"):
        kw = dict(slot_mapping=slots, positions=positions, eps=eps,
                  rope_theta=c.rope_theta if layer == "sliding" else None,
                  ssmax=None if layer == "sliding" else (c.ssmax_base, c.ssmax_exponent))
        cache_ref = cache.clone()
        q_ref = registry.reference("qk_prep").fn(q, k, val, qw, cache=cache_ref, **kw)
        for label, fn in callables(available("qk_prep", "triton")):
            out_cache = cache.clone()
            q_out = _graph_replay(lambda: fn(q, k, val, qw, cache=out_cache, **kw))
            _check(q_out, q_ref, dtype, label=f"qk_prep {layer} {label}")
            assert torch.equal(out_cache.isnan(), cache_ref.isnan())
            written = ~cache_ref.isnan()
            _check(out_cache[written], cache_ref[written], dtype, label=f"qk_prep cache {layer} {label}")

    o, g, aw = (x for x in _attn_inputs(batch, heads, hd, hidden, dtype, gen))
    o, g = o.to(dev), g.to(dev)
    aw = {key: t.to(dev) for key, t in aw.items()}
    y_ref = registry.reference("attn_out").fn(o, g, aw)
    for name in ("triton", "triton_fused", "triton_gemv", "triton_gemv_gated"):
        for label, fn in callables(available("attn_out", name)):
            assert _rel(_graph_replay(lambda: fn(o, g, aw)), y_ref) <= 2 ** -8, f"attn_out:{name} {label}"
