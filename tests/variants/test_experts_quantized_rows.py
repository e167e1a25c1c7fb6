"""`experts:triton_quantized_rows`: experts:triton_rows' whole-row decode GEMV on FP8 / NVFP4 expert weights, NVFP4
decoded by placing each code's bits into fp16. The op gate at three sequences in both formats (every config at one
sequence: test_every_variant.py; only the selected experts read: test_experts_quantized.py), misaligned NVFP4
words refused, and planted decode faults (each a one-line edit of the real kernel) rejected by the gate. CPU: the
kernels run interpreted (tests/conftest.py); their sm_90 compilation is checked in test_triton_sm90_compile.py."""

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from beam_model.quant.tensors import Nvfp4Weight  # noqa: E402
from tests.variants.helpers import edited_module  # noqa: E402
from workbench import gates, registry  # noqa: E402
from workbench.points import Workload, spec  # noqa: E402
from workbench.registry import Variant  # noqa: E402

VARIANT = registry.get("experts", "triton_quantized_rows")
# Wider blocks than any config (the same kernels, far fewer programs: quick to interpret) for the kernels' logic;
# test_every_variant.py gates each registered config
WIDE = dict(BLOCK_N=8, num_warps=4, DOWN_BLOCK_N=16, DOWN_WARPS=4)
FORMATS = ("fp8", "nvfp4")
KERNEL = Path(__file__).parents[2] / "workbench" / "variants" / "kernels" / "moe_quantized_rows.py"


def _decode(batch: int, fmt: str) -> Workload:
    return Workload(batch=batch, context=20, weights=fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_op_gate_at_three_sequences(fmt):
    report = gates.op_gate(VARIANT, [_decode(3, fmt)], seeds=(0,), config=WIDE)
    assert report.passed, report.first_failure()


def test_declines_bf16_and_refuses_misaligned_nvfp4_words():
    assert VARIANT.unsupported(_decode(1, "bf16"), "cpu") == \
        "experts:triton_quantized_rows reads fp8/nvfp4 weights, not bf16"
    x, ids, weights, w = spec("experts").make_inputs(_decode(1, "nvfp4"), "cpu", 0).args
    down = w["down_proj"]
    shifted = torch.empty(down.weight.numel() + 1, dtype=torch.uint8)[1:].view(down.weight.shape)
    shifted.copy_(down.weight)
    with pytest.raises(ValueError, match="8-byte words"):
        VARIANT.fn(x, ids, weights, {**w, "down_proj": Nvfp4Weight(shifted, down.scale, down.scale_2)})


# A line of the kernel module (its marker) and the edit that plants a decode fault there.
FAULTS = {
    # the codes' sign bit never reaches fp16's: every weight counts as positive
    "sign_dropped": ("return magnitude | (_shifted(", (" | (_shifted(word, 12 - 4 * K) & SIGN_BITS)", "")),
    # the second code of a pair taken from the word's nibble K + 3 instead of K + 4
    "wrong_nibble": ("hi = (halves >> 16)", ("halves >> 16", "halves >> 12")),
    # a block's second 8 codes multiplied by its first 8 inputs
    "word_halves_swapped": ("return (_word_dot(words.to(tl.int32), x, 0)", ("x, 1)", "x, 0)")),
    # scale_2 and the 2^14 applied to the gate but not to the up projection
    "up_scale_dropped": ("u_scale = tl.load(su2_ptr + e)", ("tl.load(su2_ptr + e) * E2M1_FROM_FP16", "1.0")),
}


def planted_kernel(fault: str, tmp_path: Path) -> Variant:
    """experts:triton_quantized_rows (at WIDE) on a copy of its kernel module with `fault` planted."""
    module = edited_module(KERNEL, *FAULTS[fault], tmp_path, f"planted_moe_quantized_rows_{fault}")

    def experts(x, ids, weights, w):
        return module.quantized_experts_rows(x, ids, weights, w, WIDE)
    return Variant("experts", f"planted_{fault}", "triton", experts, formats=FORMATS)


@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_op_gate_rejects_a_planted_decode_fault(fault, tmp_path):
    report = gates.op_gate(planted_kernel(fault, tmp_path), [_decode(1, "nvfp4")], seeds=(0,))
    assert not report.passed and "accuracy" in {c.name for c in report.failures}, report.first_failure()


def test_the_unplanted_copy_passes(tmp_path, monkeypatch):
    """The planting itself changes nothing but the line: with an edit that is no change, the copy passes."""
    monkeypatch.setitem(FAULTS, "none", ("magnitude = _shifted(word, TOP - 4 * K)", ("TOP - 4 * K", "TOP - 4 * K")))
    report = gates.op_gate(planted_kernel("none", tmp_path), [_decode(1, "nvfp4")], seeds=(0,))
    assert report.passed, report.first_failure()
