"""`experts:triton_quantized`: the decode GEMV on FP8 / NVFP4 expert weights. The op gate at every config in both
formats at beam-tiny decode of three sequences (of one: test_every_variant.py), only the selected experts read (by
experts:triton_quantized_rows too), the workloads it declines, and faults of the NVFP4 layout (nibbles swapped,
scale_2 dropped) rejected by the gate. CPU: the kernels run interpreted (tests/conftest.py); their sm_90
compilation is checked in test_triton_sm90_compile.py."""

import pytest
import torch

pytest.importorskip("triton")

from beam_model.quant.tensors import Nvfp4Weight  # noqa: E402
from tests.variants.helpers import poisoned_experts  # noqa: E402
from workbench import gates, registry  # noqa: E402
from workbench.points import Workload, spec  # noqa: E402
from workbench.variants.experts.triton_quantized import CONFIGS  # noqa: E402

VARIANT = registry.get("experts", "triton_quantized")
FORMATS = ("fp8", "nvfp4")


def _decode(batch: int, fmt: str) -> Workload:
    return Workload(batch=batch, context=20, weights=fmt)


@pytest.mark.parametrize("batch", [3])  # decode of one: test_every_variant.py gates every config there (LARGER)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_op_gate_at_every_config(index, fmt, batch):
    report = gates.op_gate(VARIANT, [_decode(batch, fmt)], seeds=(0, 1), config=CONFIGS[index])
    assert report.passed, report.first_failure()


@pytest.mark.parametrize("name", ["triton_quantized", "triton_quantized_rows"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_reads_only_the_selected_experts_bitwise_alike(fmt, name):
    variant = registry.get("experts", name)
    # the config of the fewest programs (the most rows each): the quickest interpreted
    fn = variant.configure(max(variant.configs, key=lambda c: c["BLOCK_N"] * c.get("STEPS", 1)))
    x, ids, weights, w = spec("experts").make_inputs(_decode(1, fmt), "cpu", 0).args
    unselected = torch.ones(w["gate_proj"].shape[0], dtype=torch.bool)
    unselected[ids[0]] = False
    clean = fn(x, ids, weights, w).view(torch.int16)
    assert torch.equal(fn(x, ids, weights, poisoned_experts(w, unselected)).view(torch.int16), clean)


def test_declines_bf16_weights_and_prefill_sizes():
    from workbench.variants.kernels.moe import GEMV_MAX_PAIRS

    top_k = _decode(1, "fp8").config.num_experts_per_tok
    assert VARIANT.unsupported(_decode(1, "bf16"), "cpu") == \
        "experts:triton_quantized reads fp8/nvfp4 weights, not bf16"
    for fmt in FORMATS:
        assert VARIANT.unsupported(_decode(GEMV_MAX_PAIRS // top_k, fmt), "cpu") is None
        assert "routed pairs" in VARIANT.unsupported(_decode(GEMV_MAX_PAIRS // top_k + 1, fmt), "cpu")
    x, ids, weights, w = spec("experts").make_inputs(_decode(1, "bf16"), "cpu", 0).args
    with pytest.raises(ValueError, match="fp8 or nvfp4"):
        VARIANT.fn(x, ids, weights, w)


@pytest.mark.parametrize("qualname", ["experts:triton_quantized", "experts:triton_quantized_rows",
                                      "qkvg_proj:triton_fp8", "dense_mlp:triton_fp8", "attn_out:triton_fp8"])
def test_e4m3_kernels_decline_gpus_before_sm89(qualname, monkeypatch):
    """Triton converts E4M3 on sm_89 and later: an A100 is told why, an H100 is offered the variant."""
    variant = registry.get(*qualname.split(":"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, offered in (((8, 0), False), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, c=capability: c)
        why = variant.supports(_decode(1, "fp8"))
        assert (why is True) == offered, (capability, why)
        if not offered:
            assert why == f"{qualname} loads E4M3 values, which Triton converts on sm_89 or later, not sm_80"


def _nibbles_swapped(w):
    return Nvfp4Weight((w.weight << 4) | (w.weight >> 4), w.scale, w.scale_2)


def _scale_2_dropped(w):
    return Nvfp4Weight(w.weight, w.scale, torch.ones_like(w.scale_2))


@pytest.mark.parametrize("fault", [_nibbles_swapped, _scale_2_dropped])
def test_planted_nvfp4_fault_is_rejected(fault):
    """The kernels fed weights read the wrong way (as a kernel that swapped the nibbles or forgot scale_2 would
    read them): the gate's accuracy check fails."""
    def experts(x, ids, weights, w):
        return VARIANT.fn(x, ids, weights, {k: fault(v) for k, v in w.items()})

    planted = registry.Variant("experts", f"planted{fault.__name__}", "triton", experts, formats=("nvfp4",))
    report = gates.op_gate(planted, [_decode(1, "nvfp4")], seeds=(0,))
    assert not report.passed and "accuracy" in {c.name for c in report.failures}, report.first_failure()
