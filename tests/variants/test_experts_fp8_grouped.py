"""`experts:triton_fp8_grouped`: experts:triton's grouped GEMMs on FP8 tensor cores (W8A8: FP8 weights, x and
the activation quantized per token). The op gate at every config on a prompt (held to the point's
FP8-activation tolerance), the formats it refuses, and planted faults (each a one-line edit of the real kernel)
rejected by the gate. CPU: the kernels run interpreted (tests/conftest.py)."""

from pathlib import Path

import pytest

pytest.importorskip("triton")

from tests.variants.helpers import edited_module  # noqa: E402
from workbench import gates, registry  # noqa: E402
from workbench.points import Workload, spec  # noqa: E402
from workbench.registry import Variant  # noqa: E402
from workbench.variants.experts.triton_fp8_grouped import CONFIGS  # noqa: E402

VARIANT = registry.get("experts", "triton_fp8_grouped")
KERNEL = Path(__file__).parents[2] / "workbench" / "variants" / "kernels" / "moe_quantized_grouped.py"
# 18 tokens: 72 routed pairs over beam-tiny's 16 experts, several blocks an expert at BLOCK_M 16
PROMPT = Workload(weights="fp8", batch=2, tokens_per_seq=9, context=9)


@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_op_gate_on_a_prompt_at_every_config(index):
    report = gates.op_gate(VARIANT, [PROMPT], seeds=(0,), config=CONFIGS[index])
    assert report.passed, report.first_failure()


@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
def test_other_weight_formats_are_refused_by_name(fmt):
    assert VARIANT.activations == "fp8" and VARIANT.formats == ("fp8",)
    x, ids, weights, w = spec("experts").make_inputs(Workload(weights=fmt, batch=1, context=4), "cpu", 0).args
    with pytest.raises(ValueError, match="experts:triton_fp8_grouped reads"):
        VARIANT.fn(x, ids, weights, w)


# A line of the kernel module (its marker) and the edit that plants a fault there.
FAULTS = {
    # the gate/up accumulators never take the tokens' activation scales
    "token_scale_dropped": ("token_scale = tl.load(xs_ptr + tokens)", ("tl.load(xs_ptr + tokens)[:, None]", "1.0")),
    # each output channel of down takes the weight scale of the channel beside it
    "channel_scale_shifted": ("rows = acc * _row_factor(sd_ptr", ("e, offs_n, n_ok", "e, offs_n + 1, n_ok")),
    # the down GEMM's rows take the activation scale of another block row
    "activation_scale_of_another_row": ("rows *= tl.load(as_ptr + offs_m)",
                                        ("as_ptr + offs_m", "as_ptr + (offs_m + 1) % BLOCK_M")),
}


def planted_kernel(fault: str, tmp_path: Path) -> Variant:
    """experts:triton_fp8_grouped at its default config on a copy of its kernel module with `fault`."""
    module = edited_module(KERNEL, *FAULTS[fault], tmp_path, f"planted_moe_quantized_grouped_w8a8_{fault}")

    def experts(x, ids, weights, w):
        return module.quantized_grouped_experts(x, ids, weights, w, CONFIGS[0], w8a8=True)
    return Variant("experts", f"planted_{fault}", "triton", experts, formats=("fp8",), activations="fp8")


@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_op_gate_rejects_a_planted_fault(fault, tmp_path):
    report = gates.op_gate(planted_kernel(fault, tmp_path), [PROMPT], seeds=(0,))
    assert not report.passed and "accuracy" in {c.name for c in report.failures}, report.first_failure()


def test_the_unplanted_copy_passes(tmp_path, monkeypatch):
    """The planting itself changes nothing but the line: with an edit that is no change, the copy passes."""
    monkeypatch.setitem(FAULTS, "none", ("token_scale = tl.load(xs_ptr + tokens)", ("xs_ptr", "xs_ptr")))
    report = gates.op_gate(planted_kernel("none", tmp_path), [PROMPT], seeds=(0,))
    assert report.passed, report.first_failure()
