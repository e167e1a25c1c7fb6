"""Programmatic dependent launch (PDL): a variant registered with `pdl=True` launches every kernel of a
"pdl" config early, and each of those kernels' programs waits for its predecessor in-kernel.

A kernel launched early that does not wait races the kernel before it, which the interpreter cannot
show (it runs kernels one after another). So these tests run the interpreter with PDL switched on
and stand-in grid dependency calls that count: every launch of a "pdl" config must carry PDL and
launch_pdl together, every program must wait exactly once and release its successor, and the
results must be the base config's, bit for bit. The real instructions are checked in the PTX of
kernels compiled for sm_90 (test_triton_sm90_compile.py), and on the H200 by the GPU tests.
"""

import importlib
import math
import pkgutil

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.runtime import interpreter  # noqa: E402

from workbench import gates, registry  # noqa: E402
from workbench.points import Workload, spec  # noqa: E402
from workbench.variants import kernels as kernels_package  # noqa: E402
from workbench.variants.kernels import triton_common  # noqa: E402

WORKLOADS = {
    "decode": Workload("beam-tiny", batch=2, tokens_per_seq=1, context=40),
    "prefill": Workload("beam-tiny", batch=2, tokens_per_seq=5, context=5),
}


def pdl_variants():
    return [v for p in registry.POINTS for v in registry.variants(p).values() if v.pdl]


@pytest.fixture
def launches(monkeypatch):
    """Records each kernel launch (its PDL flags and program count) and each program's grid
    dependency calls, with PDL switched on in the interpreter through stand-in calls."""
    log = {"launches": [], "wait": 0, "release": 0}
    # Kernel modules copy INTERPRETED when imported (some lazily, on a variant's first call): import
    # them all first, so only pdl_launch sees it switched off and they keep the interpreter's workarounds
    for m in pkgutil.iter_modules(kernels_package.__path__):
        try:
            importlib.import_module(f"{kernels_package.__name__}.{m.name}")
        except ImportError:  # a kernel module of an optional library that is missing here (CuTe DSL)
            pass
    monkeypatch.setattr(triton_common, "INTERPRETED", False)  # pdl_launch: PDL on
    monkeypatch.setattr(triton_common, "gdc_wait", lambda: log.__setitem__("wait", log["wait"] + 1))
    monkeypatch.setattr(triton_common, "gdc_launch_dependents",
                        lambda: log.__setitem__("release", log["release"] + 1))
    run = interpreter.GridExecutor.__call__

    def recording(self, *args, **kwargs):
        grid = self.grid if isinstance(self.grid, tuple) else None
        log["launches"].append({"kernel": self.fn.__name__, "PDL": kwargs.get("PDL"),
                                "launch_pdl": kwargs.get("launch_pdl"),
                                "programs": math.prod(grid) if grid else None})
        return run(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", recording)
    return log


def _run(v, config, call):
    c = gates._copy(call)  # fresh inputs and generators: both runs start from the same state
    weights = v.prepare_weights(c.args[c.weights_arg]) if c.weights_arg is not None else None
    with torch.no_grad():
        return gates._outputs(v.at(config)(*c.with_weights(weights).args, **c.kwargs))


def _pdl_launches(v, config, call, launches) -> list[dict]:
    """Runs `v` at `config`, then at it plus "pdl": True; the second must launch every kernel early,
    wait and release once in every program, and give the first's bits. Returns its launches."""
    expected = _run(v, config, call)
    assert launches["wait"] == 0 and all(not e["PDL"] for e in launches["launches"])
    launches["launches"].clear()
    got = _run(v, {**(config or {}), "pdl": True}, call)
    kernels = launches["launches"]
    assert kernels, f"{v.qualname} launched no Triton kernel"
    assert all(e["PDL"] is True and e["launch_pdl"] is True for e in kernels), kernels
    programs = sum(e["programs"] for e in kernels)
    assert launches["wait"] == programs and launches["release"] == programs, (launches, programs)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert gates.same_bits(a, b), v.qualname
    return kernels


def test_every_triton_decode_point_has_a_pdl_variant():
    """The points a decode step launches Triton kernels for can all be searched with PDL."""
    points = {v.point for v in pdl_variants()}
    assert {"boundary", "qkvg_proj", "qk_prep", "attention", "attn_out", "route", "experts", "dense_mlp",
            "head", "sample"} <= points, points


def test_pdl_configs_come_only_where_a_gpu_can_launch_them():
    v = next(v for v in pdl_variants() if v.configs)
    assert not registry.pdl_available()  # the CPU suite (interpreted)
    assert v.tuning_configs() == list(v.configs)


@pytest.mark.parametrize("v", pdl_variants(), ids=lambda v: v.qualname)
@pytest.mark.parametrize("kind", WORKLOADS)
def test_pdl_config_waits_in_every_program_and_changes_no_bit(v, kind, launches):
    wl = WORKLOADS[kind].with_(weights=v.formats[0])  # BF16, or the first format of a quantized-only variant
    why = v.unsupported(wl, "cpu")  # a library's kernels (FlashInfer, CuTe) need a GPU
    if why:
        pytest.skip(why)
    if v.qualname in ("experts:triton_rows", "experts:triton_persistent", "experts:triton_quantized_rows") \
            and kind == "prefill":
        pytest.skip("the decode case runs the same two kernels; this one only adds programs (~1 min interpreted)")
    _pdl_launches(v, (v.configs or [None])[0], spec(v.point).make_inputs(wl, "cpu", 0), launches)


@pytest.mark.parametrize("name", ["triton", "triton_rounded"])
def test_experts_grouped_path_waits_in_every_program(name, launches):
    """The grouped (prefill) path's five kernels, forced at a size the first config runs as a GEMV."""
    v = registry.get("experts", name)
    wl = WORKLOADS["prefill"].with_(batch=8)
    if name == "triton_rounded" and v.unsupported(wl, "cpu"):
        pytest.skip("beam-tiny's prefill routes too few pairs for the rounded variant")
    config = next(c for c in v.configs if c["path"] == "grouped")
    kernels = _pdl_launches(v, config, spec("experts").make_inputs(wl, "cpu", 0), launches)
    assert {e["kernel"] for e in kernels} >= {"count_by_expert_kernel", "align_by_expert_kernel",
                                              "gate_up_grouped_kernel", "down_grouped_kernel", "_combine"}


def test_attn_out_gemv_gated_is_one_kernel_at_decode(launches):
    """The gate is the GEMV's prologue: one launch per call where attn_out:triton_gemv makes two."""
    v = registry.get("attn_out", "triton_gemv_gated")
    kernels = _pdl_launches(v, v.configs[0], spec("attn_out").make_inputs(WORKLOADS["decode"], "cpu", 0), launches)
    assert [e["kernel"] for e in kernels] == ["_gated_gemv_fma"]


def test_attention_out_tasks_is_one_kernel_at_decode(launches):
    """Attention, merge-gate and o_proj tasks in one launch, every program waiting once before its
    first ticket (two decode rows: the config that takes several)."""
    v = registry.get("attention_out", "triton_tasks")
    config = next(c for c in v.configs if c["max_tokens"] >= 2)
    kernels = _pdl_launches(v, config, spec("attention_out").make_inputs(WORKLOADS["decode"], "cpu", 0), launches)
    assert [e["kernel"] for e in kernels] == ["_tasks_kernel"]
