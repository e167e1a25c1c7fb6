"""`qkvg_proj:cute`, the CuTe DSL decode GEMV of `qkvg_proj`, against the torch reference.

(Registration, imports and `supports`: test_cute_variants.py; the op gate at every tuning config:
test_every_variant.py.) More than 16 rows (a prompt) go through one GEMM on the packed weight, checked
on the CPU. The `gpu` test replays the kernel in a CUDA graph with new inputs.
"""


import pytest
import torch

from tests.variants.helpers import available, callables, on_gpu_unless_quarantined
from workbench import registry
from workbench.points import Workload, spec

on_gpu = on_gpu_unless_quarantined("qkvg_proj", "cute")


# ---- on the GPU ----------------------------------------------------------------------------------

def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("preset", ["beam-tiny", "beam-501b-tp8"])
def test_gpu_cuda_graph_replay(preset):
    """Captured once, replayed on new values written into the captured input: no host sync, no stale
    result, and the launch goes to torch's current stream (torch.cuda.graph captures on a side stream)."""
    v, ref = available("qkvg_proj", "cute"), registry.reference("qkvg_proj")
    point, wl = spec("qkvg_proj"), Workload(preset, batch=8)
    x, w = point.make_inputs(wl, "cuda", 1).args
    packed = v.prepare_weights(w)
    tol = point.tolerance[wl.dtype]
    for label, fn in callables(v):
        fn(x, packed)  # compile and load outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = fn(x, packed)
        for seed in (2, 3):
            x.copy_(point.make_inputs(wl, "cuda", seed).args[0])
            graph.replay()
            torch.cuda.synchronize()
            refs = ref.fn(x.double(), {k: t.double() for k, t in w.items()})
            for name, o, r in zip("qkvg", outs, refs):
                assert o.shape == r.shape and o.is_contiguous(), (label, name)
                assert _rel(o, r) <= tol, (label, name, seed, _rel(o, r))


def test_prompt_rows_take_one_gemm_on_the_packed_weight():
    """More rows than the GEMV holds never reach the kernel (this runs without cutlass or a GPU)."""
    v, ref = registry.get("qkvg_proj", "cute"), registry.reference("qkvg_proj")
    g = torch.Generator().manual_seed(0)
    w = {p: torch.randn(n, 64, generator=g) for p, n in (("q_proj", 32), ("k_proj", 16), ("v_proj", 16),
                                                      ("gate_proj", 32))}
    x = torch.randn(17, 64, generator=g)
    for (_, fn) in callables(v):
        for got, want in zip(fn(x, v.prepare_weights(w)), ref.fn(x, w)):
            assert got.is_contiguous() and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
