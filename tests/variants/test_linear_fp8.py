"""The weight-only FP8 GEMV variants (`kernels/gemv_fp8.py`): qkvg_proj:triton_fp8, dense_mlp:triton_fp8 and
attn_out:triton_fp8. The op gate at every config at beam-tiny decode of three sequences (of one:
test_every_variant.py), the workloads they decline, and faults of the scale handling (scales of the wrong
rows, scales skipped) rejected by the gate. CPU: the kernel runs interpreted (tests/conftest.py); its sm_90
compilation is checked in test_triton_sm90_compile.py."""

import pytest
import torch

pytest.importorskip("triton")

from beam_model.quant.tensors import Fp8Weight  # noqa: E402
from workbench import gates, registry  # noqa: E402
from workbench.points import Workload  # noqa: E402

POINTS = ("qkvg_proj", "dense_mlp", "attn_out")


def _decode(batch: int, fmt: str = "fp8") -> Workload:
    return Workload(batch=batch, context=20, weights=fmt)


def _cases():
    for point in POINTS:
        v = registry.get(point, "triton_fp8")
        for index in range(len(v.configs)):
            for batch in (3,):  # decode of one: test_every_variant.py gates every config there (LARGER)
                yield pytest.param(point, index, batch, id=f"{point}#{index}-b{batch}")


@pytest.mark.parametrize("point, index, batch", list(_cases()))
def test_op_gate_at_every_config(point, index, batch):
    v = registry.get(point, "triton_fp8")
    report = gates.op_gate(v, [_decode(batch)], seeds=(0, 1), config=v.configs[index])
    assert report.passed, report.first_failure()


@pytest.mark.parametrize("point", POINTS)
def test_declines_bf16_weights_prefill_sizes_and_non_float_dtypes(point):
    from workbench.variants.kernels.gemv_fp8 import MAX_ROWS

    v = registry.get(point, "triton_fp8")
    assert v.unsupported(_decode(1, "bf16"), "cpu") == f"{point}:triton_fp8 reads fp8 weights, not bf16"
    assert v.unsupported(_decode(MAX_ROWS), "cpu") is None
    assert "rows" in v.unsupported(_decode(MAX_ROWS + 1), "cpu")
    assert "int8" in str(v.supports(_decode(1).with_(dtype="int8")))


def _wrong_rows(w):
    return Fp8Weight(w.weight, w.scale.roll(1, dims=0))


def _scale_skipped(w):
    return Fp8Weight(w.weight, torch.ones_like(w.scale))


@pytest.mark.parametrize("fault", [_wrong_rows, _scale_skipped])
@pytest.mark.parametrize("point", ["qkvg_proj", "dense_mlp"])
@pytest.mark.parametrize("name", ["triton_fp8", "triton_fp8_rows"])
def test_planted_scale_fault_is_rejected(name, point, fault):
    """The kernel fed each row another row's scale, or no scale (as a kernel that indexed the scales wrong or
    skipped them would compute): the gate's accuracy check fails. Also for the whole-row GEMV
    (`kernels/gemv_fp8_rows.py`, test_fp8_rows_gemv.py)."""
    v = registry.get(point, name)

    def planted_fn(*args):
        *acts, w = args
        return v.fn(*acts, {k: fault(t) if isinstance(t, Fp8Weight) else t for k, t in w.items()})

    planted = registry.Variant(point, f"planted{fault.__name__}", "triton", planted_fn, formats=("fp8",),
                               prepare=v.prepare)  # qkvg_proj's packs the four weights first
    report = gates.op_gate(planted, [_decode(1)], seeds=(0,))
    assert not report.passed and "accuracy" in {c.name for c in report.failures}, report.first_failure()


@pytest.mark.parametrize("swiglu", [False, True])
def test_rows_past_the_tiles_are_computed_as_the_reference_computes_them(swiglu):
    """Past MAX_ROWS (a prompt through a decode lock) `fp8_linear` hands the rows to the dequantized GEMM the
    reference runs, so they match it bitwise."""
    from beam_model.functional import linear
    from beam_model.quant.formats import quantize_fp8
    from workbench.variants.kernels import gemv_fp8
    from workbench.variants.kernels.fp8_decode import CONFIGS

    g = torch.Generator().manual_seed(0)
    w, up = (Fp8Weight(*quantize_fp8(torch.randn(24, 64, generator=g) * 0.05)) for _ in range(2))
    x = torch.randn(gemv_fp8.MAX_ROWS + 4, 64, generator=g).bfloat16()
    got = gemv_fp8.fp8_linear(x, w, CONFIGS[0], up=up if swiglu else None)
    want = linear(x, w)
    if swiglu:
        want = (torch.nn.functional.silu(want.float()) * linear(x, up).float()).to(x.dtype)
    assert torch.equal(got, want)
