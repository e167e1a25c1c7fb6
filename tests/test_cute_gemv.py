"""`qkvg_proj:cute`, the CuTe DSL decode GEMV of `qkvg_proj`, against the torch reference.

On the CPU: the variant is registered whether or not cutlass is installed, `qkvg_proj.py` imports
without it, and `supports` turns down what the kernel cannot do (16-bit dtypes, whole 16-byte vectors)
with a reason. More than 16 rows (a prompt) go through one GEMM on the packed weight. The `gpu` tests
run the op gate at beam-tiny and beam-501b-tp8 shapes for 1, 8 and 16 tokens at every tuning config
(each one a separately compiled kernel) and at a prefill chunk, and replay the kernel in a CUDA graph
with new inputs.
"""

import dataclasses
import importlib.util
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.variant_helpers import available, callables
from workbench import gates, registry
from workbench.points import Workload, spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_CUTLASS = importlib.util.find_spec("cutlass") is not None
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ---- on the CPU ----------------------------------------------------------------------------------

def test_registered_with_its_configs():
    v = registry.get("qkvg_proj", "cute")
    assert v.backend == "cute" and v.configs and v.prepare is not None
    assert all(callable(v.at(cfg)) for cfg in v.configs)


@pytest.mark.skipif(HAS_CUTLASS, reason="cutlass is installed here")
def test_unavailable_without_cutlass():
    v = registry.get("qkvg_proj", "cute")
    why = v.unsupported(Workload("beam-tiny"))
    assert why is not None and "cutlass" in why
    with pytest.raises(RuntimeError, match="cutlass"):
        registry.bind({"qkvg_proj": "cute"})


def test_point_imports_without_the_kernel_module():
    """The kernel module (and cutlass) is imported by the variant's first call, not by `qkvg_proj.py`."""
    code = ("import sys, workbench.variants.qkvg_proj; "
            "assert 'workbench.variants._cute_gemv' not in sys.modules and 'cutlass' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def _workload(hidden, dtype="bf16", tokens=1):
    return SimpleNamespace(config=SimpleNamespace(hidden_size=hidden), dtype=dtype, tokens=tokens)


@pytest.mark.parametrize("preset", ["beam-tiny", "beam-small", "beam-501b-tp8"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("batch", [1, 8, 16, 64])
def test_supports_decode_at_the_presets(preset, dtype, batch):
    assert registry.get("qkvg_proj", "cute").supports(Workload(preset, batch=batch, dtype=dtype)) is True


@pytest.mark.parametrize("workload, words", [
    (Workload("beam-tiny", dtype="fp32"), "fp32"),
    (_workload(60), "multiple of 8"),
    (_workload(5124), "multiple of 8"),
])
def test_supports_turns_down_with_a_reason(workload, words):
    verdict = registry.get("qkvg_proj", "cute").supports(workload)
    assert isinstance(verdict, str) and words in verdict


# ---- on the GPU ----------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("preset", ["beam-tiny", "beam-501b-tp8"])
def test_gpu_op_gate(preset):
    v = available("qkvg_proj", "cute")
    wls = [Workload(preset, batch=b) for b in (1, 8, 16)]
    wls.append(Workload(preset, batch=2, tokens_per_seq=64, context=128))  # a prompt: the packed GEMM
    for config in v.configs:  # the gate runs variant.fn: bind each tuning config in turn
        report = gates.op_gate(dataclasses.replace(v, fn=v.at(config)), wls, device="cuda", seeds=(0,))
        assert report.passed, (config, [(c.name, c.case, c.error, c.detail) for c in report.failures][:5])


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.gpu
@needs_cuda
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
