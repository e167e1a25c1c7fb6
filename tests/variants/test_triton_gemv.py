"""The packed and Triton variants of `qkvg_proj` and `dense_mlp` (workbench/variants/kernels/gemv.py).

CPU: the Triton interpreter at tiny shapes (odd sizes, so every mask and split-K tail is exercised),
every tuning config, M = 1, 3, 16 (GEMV sizes) and 40 (tiled path), FP32 and BF16, against the
reference and an FP64 truth. GPU (`-m gpu`): the TP8 shapes at M = 1, 8, 64.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.variants.helpers import needs_cuda
from workbench import registry

pytest.importorskip("triton")

QKVG, DENSE = registry.variants("qkvg_proj"), registry.variants("dense_mlp")
PARTS = ("q_proj", "k_proj", "v_proj", "gate_proj")
MS = (1, 3, 16, 20)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def qkvg_weights(sizes, k, dtype, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return {p: (torch.randn(n, k, generator=g, device=device) / k ** 0.5).to(dtype) for p, n in zip(PARTS, sizes)}


def dense_weights(hidden, ff, dtype, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    shapes = {"gate_proj": (ff, hidden), "up_proj": (ff, hidden), "down_proj": (hidden, ff)}
    return {k: (torch.randn(*s, generator=g, device=device) / s[1] ** 0.5).to(dtype) for k, s in shapes.items()}


def qkvg_truth(x, w):
    return [x.double() @ w[p].double().T for p in PARTS]


def dense_truth(x, w):
    x = x.double()
    g, u = x @ w["gate_proj"].double().T, x @ w["up_proj"].double().T
    return (F.silu(g) * u) @ w["down_proj"].double().T


def check_qkvg(fn, x, w, prepared, dtype):
    """Shapes, strides (contiguous), error vs FP64 within tolerance or no worse than the reference's,
    and (at M = 3: the interpreter is slow) the same bits on a second run."""
    ref, out, truth = QKVG["torch"].fn(x, w), fn(x, prepared), qkvg_truth(x, w)
    for o, r, t in zip(out, ref, truth):
        assert o.shape == r.shape and o.dtype == r.dtype and o.is_contiguous() and o.stride() == r.stride()
        assert rel(o, t) <= max(TOL[dtype], 1.5 * rel(r, t)), (rel(o, t), rel(r, t))
    assert x.shape[0] != 3 or all(torch.equal(a, b) for a, b in zip(out, fn(x, prepared)))


# ---- qkvg_proj ---------------------------------------------------------------------------------------

SIZES, HIDDEN = (32, 16, 16, 32), 24  # K = 24: a masked tail in every K tile size


def test_qkvg_packed_is_exact_in_fp32():
    """The packed transform is lossless: the same bits as four separate GEMMs (on this BLAS)."""
    w = qkvg_weights(SIZES, HIDDEN, torch.float32)
    packed = QKVG["packed"].prepare_weights(w)
    assert torch.equal(packed["qkvg"], torch.cat([w[p] for p in PARTS]))
    for m in MS:
        x = torch.randn(m, HIDDEN)
        for o, r in zip(QKVG["packed"].fn(x, packed), QKVG["torch"].fn(x, w)):
            assert torch.equal(o, r) and o.is_contiguous() and o.stride() == r.stride()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkvg_packed(dtype):
    w = qkvg_weights(SIZES, HIDDEN, dtype)
    prepared = QKVG["packed"].prepare_weights(w)
    for m in MS:
        check_qkvg(QKVG["packed"].fn, torch.randn(m, HIDDEN).to(dtype), w, prepared, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", range(len(QKVG["triton"].configs)))
def test_qkvg_triton(cfg, dtype):
    v = QKVG["triton"]
    w = qkvg_weights((5, 2, 2, 5), HIDDEN, dtype)  # 14 rows: partial N tiles
    prepared, fn = v.prepare_weights(w), v.at(v.configs[cfg])
    for m in MS:
        check_qkvg(fn, torch.randn(m, HIDDEN).to(dtype), w, prepared, dtype)
    assert not prepared["locks"].any()  # split-K counters are left at zero


def test_triton_default_is_first_config():
    for v in (QKVG["triton"], DENSE["triton"], DENSE["triton_gemv"]):
        assert v.fn.__defaults__[-1] is v.configs[0]


def test_split_k_tail_and_strided_x():
    """Split-K with several live splits and an empty one, a K tail, and x a strided view."""
    from workbench.variants.kernels import gemv as tg

    locks = tg.new_locks("cpu")
    x, w = torch.randn(5, 300)[:, :200], torch.randn(37, 200)
    for dot in (False, True):
        cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=8, DOT=dot, num_warps=4, num_stages=1)
        y = tg.linear(x, w, cfg, locks)
        assert rel(y, x.double() @ w.double().T) < 1e-6 and torch.equal(y, tg.linear(x, w, cfg, locks))
        assert not locks.any()


# ---- dense_mlp ---------------------------------------------------------------------------------------

D_HIDDEN, D_FF = 24, 12


def check_dense(fn, x, w, prepared, dtype):
    ref, out, truth = DENSE["torch"].fn(x, w), fn(x, prepared), dense_truth(x, w)
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous()
    assert rel(out, truth) <= max(TOL[dtype], 1.5 * rel(ref, truth)), (rel(out, truth), rel(ref, truth))
    assert x.shape[0] != 3 or torch.equal(out, fn(x, prepared))  # deterministic
    return out


def test_dense_packing_is_exact_in_fp32():
    w = dense_weights(D_HIDDEN, 48, torch.float32)
    packed = DENSE["triton"].prepare_weights(w)
    for m in MS:
        x = torch.randn(m, D_HIDDEN)
        assert torch.equal(F.linear(x, packed["gate_up"]), torch.cat([F.linear(x, w["gate_proj"]),
                                                                     F.linear(x, w["up_proj"])], 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", range(len(DENSE["triton"].configs)))
def test_dense_triton_activation(cfg, dtype):
    v = DENSE["triton"]
    w = dense_weights(D_HIDDEN, D_FF, dtype)
    prepared, fn = v.prepare_weights(w), v.at(v.configs[cfg])
    for m in MS:
        x = torch.randn(m, D_HIDDEN).to(dtype)
        out = check_dense(fn, x, w, prepared, dtype)
        if dtype == torch.float32:  # same GEMMs and activation formula as the reference
            torch.testing.assert_close(out, DENSE["torch"].fn(x, w), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", range(len(DENSE["triton_gemv"].configs)))
def test_dense_triton_gemv(cfg, dtype):
    v = DENSE["triton_gemv"]
    w = dense_weights(D_HIDDEN, D_FF, dtype)
    prepared, fn = v.prepare_weights(w), v.at(v.configs[cfg])
    for m in MS:
        check_dense(fn, torch.randn(m, D_HIDDEN).to(dtype), w, prepared, dtype)
    assert not prepared["locks"].any()


def test_supports():
    from workbench.points import Workload

    for v in (QKVG["triton"], DENSE["triton"], DENSE["triton_gemv"]):
        assert v.supports(Workload(batch=1)) is True and v.supports(Workload(batch=64)) is True
        assert isinstance(v.supports(Workload(dtype="fp8")), str)


# ---- GPU: TP8 shapes ---------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize("variant", ["packed", "triton"])
def test_qkvg_tp8_gpu(variant, m):
    v = QKVG[variant]
    w = qkvg_weights((768, 128, 128, 768), 5120, torch.bfloat16, device="cuda")
    prepared = v.prepare_weights(w)
    x = torch.randn(m, 5120, device="cuda").bfloat16()
    truth, ref = qkvg_truth(x, w), QKVG["torch"].fn(x, w)
    for cfg in v.configs or [None]:
        fn = v.at(cfg)
        out = fn(x, prepared)
        for o, r, t in zip(out, ref, truth):
            assert o.is_contiguous() and o.stride() == r.stride()
            assert rel(o, t) <= max(1e-2, 1.5 * rel(r, t)), (cfg, rel(o, t), rel(r, t))
        assert all(torch.equal(a, b) for a, b in zip(out, fn(x, prepared))), cfg
        g = torch.cuda.CUDAGraph()  # capturable: no host syncs, no allocation outside the graph pool
        with torch.cuda.graph(g):
            graphed = fn(x, prepared)
        g.replay()
        assert all(torch.equal(a, b) for a, b in zip(out, graphed)), cfg
    if v.configs:
        assert not prepared["locks"].any()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize("variant", ["triton", "triton_gemv"])
def test_dense_tp8_gpu(variant, m):
    v = DENSE[variant]
    w = dense_weights(5120, 2560, torch.bfloat16, device="cuda")
    prepared = v.prepare_weights(w)
    x = torch.randn(m, 5120, device="cuda").bfloat16()
    truth, ref = dense_truth(x, w), DENSE["torch"].fn(x, w)
    for cfg in v.configs:
        fn = v.at(cfg)
        out = fn(x, prepared)
        assert out.shape == ref.shape and out.is_contiguous()
        assert rel(out, truth) <= max(1e-2, 1.5 * rel(ref, truth)), (cfg, rel(out, truth), rel(ref, truth))
        assert torch.equal(out, fn(x, prepared)), cfg
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            graphed = fn(x, prepared)
        g.replay()
        assert torch.equal(out, graphed), cfg
    assert not prepared["locks"].any()
