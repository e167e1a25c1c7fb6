"""`experts:triton_quantized_grouped`: experts:triton's grouped GEMMs on FP8 / NVFP4 expert weights, each tile
dequantized exactly before its dot. The op gate at every config on a prompt in both formats (decode of one
sequence: test_every_variant.py), and planted faults (each a one-line edit of the real kernel) rejected by the
gate. CPU: the kernels run interpreted (tests/conftest.py)."""

from pathlib import Path

import pytest

pytest.importorskip("triton")

from tests.variants.helpers import edited_module  # noqa: E402
from workbench import gates, registry  # noqa: E402
from workbench.points import Workload  # noqa: E402
from workbench.registry import Variant  # noqa: E402
from workbench.variants.experts.triton_quantized_grouped import CONFIGS  # noqa: E402

VARIANT = registry.get("experts", "triton_quantized_grouped")
FORMATS = ("fp8", "nvfp4")
KERNEL = Path(__file__).parents[2] / "workbench" / "variants" / "kernels" / "moe_quantized_grouped.py"
# 18 tokens: 72 routed pairs over beam-tiny's 16 experts, several blocks an expert at BLOCK_M 16
PROMPT = dict(batch=2, tokens_per_seq=9, context=9)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_op_gate_on_a_prompt_at_every_config(index, fmt):
    report = gates.op_gate(VARIANT, [Workload(weights=fmt, **PROMPT)], seeds=(0,), config=CONFIGS[index])
    assert report.passed, report.first_failure()


# The format a fault shows in, a line of the kernel module (its marker) and the edit that plants the fault there.
FAULTS = {
    # each NVFP4 block takes the scale of another block
    "block_scale_shifted": ("nvfp4", "scale = tl.load(s_ptr + e * stride_se",
                            ("+ blk[None, :], mask", "+ blk[None, :] // 2, mask")),
    # scale_2 (NVFP4) never applied to the accumulator
    "scale_2_dropped": ("nvfp4", "return tl.zeros([offs_n.shape[0]], tl.float32) + tl.load",
                        ("+ tl.load(s2_ptr + e)", "+ 1.0")),
    # the codes' sign bits never reach their format's
    "sign_dropped": ("nvfp4", "halves = e2m1_halves(b * 4097", ("0, BF16)", "0, BF16) & 0x7FFF7FFF")),
    # the two 16-bit values of each register in each other's place (each byte's two codes)
    "nibbles_swapped": ("nvfp4", "values = tl.join(halves", ("join(halves.to(tl.int16), (halves >> 16).to(tl.int16))",
                                                            "join((halves >> 16).to(tl.int16), halves.to(tl.int16))")),
    # E4M3's sign bit never reaches the format's
    "fp8_sign_dropped": ("fp8", "halves = ((pairs << LOW)", (" | ((pairs << 8) & SIGN_BITS)", "")),
    # each two adjacent FP8 inputs' bytes in each other's place
    "fp8_bytes_swapped": ("fp8", "pairs = even | (odd << 16)", ("even | (odd << 16)", "odd | (even << 16)")),
    # the routing weights never reach the combine of the pairs' rounded rows
    "routing_weights_dropped": ("fp8", "return combine(out, rw", ("weighted=True", "weighted=False")),
}


def planted_kernel(fault: str, tmp_path: Path) -> Variant:
    """experts:triton_quantized_grouped at its default config on a copy of its kernel module with `fault`."""
    module = edited_module(KERNEL, *FAULTS[fault][1:], tmp_path, f"planted_moe_quantized_grouped_{fault}")

    def experts(x, ids, weights, w):
        return module.quantized_grouped_experts(x, ids, weights, w, CONFIGS[0])
    return Variant("experts", f"planted_{fault}", "triton", experts, formats=FORMATS)


@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_op_gate_rejects_a_planted_fault(fault, tmp_path):
    report = gates.op_gate(planted_kernel(fault, tmp_path), [Workload(weights=FAULTS[fault][0], **PROMPT)],
                           seeds=(0,))
    assert not report.passed and "accuracy" in {c.name for c in report.failures}, report.first_failure()
