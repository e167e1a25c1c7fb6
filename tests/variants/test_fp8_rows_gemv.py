"""The whole-row FP8 GEMV (`kernels/gemv_fp8_rows.py`): qkvg_proj:triton_fp8_rows, attn_out:triton_fp8_rows and
dense_mlp:triton_fp8_rows. Each config is gated at beam-tiny decode in test_every_variant.py; here the kernel
at shapes beam-tiny lacks (K past a power of two, rows past a program's block) against float64 math, the
workloads the variants decline, and faults planted in the real kernel, one line each, rejected by the op gate.
The scale faults are test_linear_fp8.py's; the sm_90 compilation (no spills, weights read before the PDL
wait) is in test_triton_sm90_compile.py."""

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from beam_model.quant.formats import quantize_fp8  # noqa: E402
from beam_model.quant.tensors import Fp8Weight  # noqa: E402
from tests.variants.helpers import edited_module  # noqa: E402
from workbench import gates, registry  # noqa: E402
from workbench.points import Workload  # noqa: E402
from workbench.registry import Variant  # noqa: E402
from workbench.variants.kernels import gemv_fp8_rows  # noqa: E402

KERNEL = Path(__file__).parents[2] / "workbench" / "variants" / "kernels" / "gemv_fp8_rows.py"
POINTS = ("qkvg_proj", "attn_out", "dense_mlp")


def _fp8(n: int, k: int, seed: int) -> Fp8Weight:
    g = torch.Generator().manual_seed(seed)
    codes, scale = quantize_fp8(torch.randn(n, k, generator=g) * 0.05)
    return Fp8Weight(codes, scale)


def _exact(w: Fp8Weight) -> torch.Tensor:
    return w.weight.double() * w.scale.double()


@pytest.mark.parametrize("m", [1, 3, 12, 20])
@pytest.mark.parametrize("mode", ["plain", "gated", "swiglu"])
def test_rows_past_a_power_of_two_and_a_partial_row_block_match_float64(mode, m):
    """K = 96 (a 64-input piece and a 32-input one), N = 10 rows in blocks of 4 (the last block half empty); past
    ROWS activation rows, gemv_fp8's row tiles (12) and the dequantized GEMM (20)."""
    n, heads, hd = 10, 3, 32
    k = heads * hd
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=g)
    w, up = _fp8(n, k, 2), _fp8(n, k, 3)
    cfg = dict(BLOCK_N=4, num_warps=4)
    if mode == "gated":
        gate, bias = torch.randn(m, k, generator=g), torch.randn(heads, generator=g)
        got = gemv_fp8_rows.fp8_rows_linear(x.view(m, heads, hd), w, cfg, gate=(gate, bias))
        gated = x.double().view(m, heads, hd) * torch.sigmoid(gate.double().view(m, heads, hd) + bias.double()[:, None])
        want = gated.reshape(m, k) @ _exact(w).T
    elif mode == "swiglu":
        got = gemv_fp8_rows.fp8_rows_linear(x, w, cfg, up=up)
        want = torch.nn.functional.silu(x.double() @ _exact(w).T) * (x.double() @ _exact(up).T)
    else:
        got = gemv_fp8_rows.fp8_rows_linear(x, w, cfg)
        want = x.double() @ _exact(w).T
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("point", POINTS)
def test_declines_bf16_weights_prefill_sizes_and_non_float_dtypes(point):
    v = registry.get(point, "triton_fp8_rows")
    decode = Workload(context=20, weights="fp8")
    assert v.unsupported(decode.with_(weights="bf16"), "cpu") == f"{point}:triton_fp8_rows reads fp8 weights, not bf16"
    assert v.unsupported(decode.with_(batch=gemv_fp8_rows.ROWS), "cpu") is None
    assert "gemv_fp8" in v.unsupported(decode.with_(batch=gemv_fp8_rows.ROWS + 1), "cpu")
    assert "int8" in str(v.supports(decode.with_(dtype="int8")))


def test_refuses_weights_it_cannot_read():
    w = _fp8(4, 32, 0)
    with pytest.raises(ValueError, match="reads fp8 weights, got bf16"):
        gemv_fp8_rows.fp8_rows_linear(torch.randn(1, 32), torch.randn(4, 32), gemv_fp8_rows.CONFIGS[0])
    with pytest.raises(ValueError, match="one shape"):
        gemv_fp8_rows.fp8_rows_linear(torch.randn(1, 32), w, gemv_fp8_rows.CONFIGS[0], up=_fp8(8, 32, 1))


# fault -> (the line's marker, (old, new)) in gemv_fp8_rows.py
FAULTS = {
    # the inputs past K's power of two ignored (K = 768, beam-mini's dense down projection)
    "second_piece_dropped": ("return (tl.sum(wa.to(tl.float32) * xa, axis=1)",
                             (" + tl.sum(wb.to(tl.float32) * xb, axis=1)", "")),
    # attn_out's activations taken ungated
    "gate_dropped": ("        if GATED:", ("if GATED:", "if False:")),
}
# where each fault shows: the point and the workload it is gated at
WHERE = {"second_piece_dropped": ("dense_mlp", Workload("beam-mini", context=20, weights="fp8")),
         "gate_dropped": ("attn_out", Workload(context=20, weights="fp8"))}


def planted(point: str, fault: str, tmp_path: Path) -> Variant:
    """`point`'s triton_fp8_rows variant on a copy of the kernel module with `fault` planted."""
    module = edited_module(KERNEL, *FAULTS[fault], tmp_path, f"planted_gemv_fp8_rows_{fault}")
    cfg = gemv_fp8_rows.CONFIGS[0]
    calls = {"attn_out": lambda o, g, w: module.fp8_rows_linear(o, w["o_proj"], cfg, gate=(g, w["gate_bias"])),
             "dense_mlp": lambda x, w: module.fp8_rows_linear(
                 module.fp8_rows_linear(x, w["gate_proj"], cfg, up=w["up_proj"]), w["down_proj"], cfg)}
    return Variant(point, f"planted_{fault}", "triton", calls[point], formats=("fp8",))


@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_op_gate_rejects_a_planted_fault(fault, tmp_path):
    point, workload = WHERE[fault]
    report = gates.op_gate(planted(point, fault, tmp_path), [workload], seeds=(0,))
    assert not report.passed and "accuracy" in {c.name for c in report.failures}, report.first_failure()


@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_unplanted_copy_passes_where_the_fault_would_show(fault, tmp_path, monkeypatch):
    """The planting itself changes nothing but the line: with an edit that is no change, the copy passes at the
    fault's own workload."""
    marker, (old, _) = FAULTS[fault]
    monkeypatch.setitem(FAULTS, fault, (marker, (old, old)))
    point, workload = WHERE[fault]
    report = gates.op_gate(planted(point, fault, tmp_path), [workload], seeds=(0,))
    assert report.passed, report.first_failure()


@pytest.mark.parametrize("point", POINTS)
def test_every_config_runs_at_the_tp8_rank(point):
    """At beam-501b-tp8's decode every config runs (the sm_90 compile test checks that none spills there)."""
    v = registry.get(point, "triton_fp8_rows")
    rank = Workload(preset="beam-501b-tp8", context=20, weights="fp8")
    assert all(v.unsupported_config(c, rank) is None for c in v.configs)


@pytest.mark.parametrize("preset", ["beam-small", "beam-501b"])
def test_attn_out_rows_that_would_spill_are_declined(preset):
    """attn_out's rows are a rank's heads x head_dim: beam-small's (2048) and the unsharded model's (6144) are
    longer than the TP8 rank's (768), and its 32-row programs are declined there, naming why."""
    v = registry.get("attn_out", "triton_fp8_rows")
    widest = max(v.configs, key=lambda c: c["BLOCK_N"] / c["num_warps"])
    why = v.unsupported_config(widest, Workload(preset=preset, context=20, weights="fp8"))
    assert why is not None and "spill" in why, why
