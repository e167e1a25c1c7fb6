"""Quantized weights through the harness: the points' inputs store exactly the projections the format
quantizes, every reference passes its own gate on them, a variant reads only the formats it declares, and
the faults particular to the formats (nibbles, scales, E4M3 overflow) are rejected by the op gate."""

import pytest
from planted import ACTIVATION_PLANTED, QUANT_PLANTED, activation_planted, quant_planted

from beam_model.quant.tensors import is_quantized
from workbench import registry
from workbench.gates import op_gate
from workbench.points import Workload, spec

DECODE = Workload(batch=3, context=20)
PREFILL = Workload(batch=2, tokens_per_seq=9, context=20)
QUANTIZED_POINTS = ("qkvg_proj", "attn_out", "dense_mlp", "experts", "attention_out")


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("point", registry.POINTS)
def test_inputs_store_what_the_format_quantizes(point, fmt):
    s = spec(point)
    call = s.make_inputs(DECODE.with_(weights=fmt), "cpu", 0)
    if call.weights_arg is None:
        assert not s.quantized
        return
    w = call.args[call.weights_arg]
    stored = sorted(k for k, v in w.items() if is_quantized(v))
    assert stored == sorted(s.quantized.get(fmt, ())), point
    assert all(v.format == fmt for v in w.values() if is_quantized(v))
    assert (point in QUANTIZED_POINTS) == bool(s.quantized)
    if stored:  # the roofline counts the stored bytes
        assert s.bytes(DECODE.with_(weights=fmt)) < s.bytes(DECODE)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("point", QUANTIZED_POINTS)
def test_the_reference_passes_on_quantized_weights(point, fmt):
    report = op_gate(registry.reference(point), [DECODE.with_(weights=fmt), PREFILL.with_(weights=fmt)], seeds=(0,))
    assert report.passed, report.first_failure()


def test_a_variant_reads_only_the_formats_it_declares():
    packed = registry.get("qkvg_proj", "packed")
    assert packed.unsupported(DECODE.with_(weights="fp8")) == "qkvg_proj:packed reads bf16 weights, not fp8"
    assert packed.unsupported(DECODE.with_(weights="nvfp4")) is None  # NVFP4 leaves the attention in BF16
    assert registry.reference("experts").unsupported(DECODE.with_(weights="nvfp4")) is None
    assert registry.get("experts", "torch_compile").formats == registry.WEIGHT_FORMATS


def test_the_registry_and_the_tensors_name_the_same_formats():
    from beam_model.quant.tensors import WEIGHT_FORMATS

    assert WEIGHT_FORMATS == registry.WEIGHT_FORMATS


@pytest.mark.parametrize("name", sorted(QUANT_PLANTED))
def test_planted_quantization_fault_is_rejected(name):
    point, _, check, fmt = QUANT_PLANTED[name]
    variant = quant_planted(name)
    workloads = [DECODE.with_(weights=fmt), PREFILL.with_(weights=fmt)]
    assert variant.unsupported(workloads[0]) is None
    report = op_gate(variant, workloads, seeds=(0, 1))
    failed = {c.name for c in report.failures}
    assert not report.passed and check in failed, f"{name} should fail {check!r}; failed {sorted(failed)}"


@pytest.mark.parametrize("name", sorted(ACTIVATION_PLANTED))
def test_planted_activation_quantization_fault_is_rejected(name):
    """A variant that quantizes its activations per token is held to its point's FP8-activation tolerance,
    a looser one: a dropped activation scale, one scale for every token (larger tokens saturate) and
    activations quantized without saying so are still rejected."""
    point, _, check, _ = ACTIVATION_PLANTED[name]
    report = op_gate(activation_planted(name), [DECODE.with_(weights="fp8"), PREFILL.with_(weights="fp8")],
                     seeds=(0, 1))
    failed = {c.name for c in report.failures}
    assert not report.passed and check in failed, f"{name} should fail {check!r}; failed {sorted(failed)}"


@pytest.mark.parametrize("point", ["qkvg_proj", "attn_out", "dense_mlp"])
def test_the_w8a8_variants_pass_at_a_tp8_ranks_prompt(point):
    """The honest per-token FP8 variants, where the planted ones above fail, and at a TP8 rank's widths."""
    workloads = [DECODE.with_(weights="fp8"), PREFILL.with_(weights="fp8"),
                 Workload("beam-501b-tp8", batch=1, tokens_per_seq=16, context=16, weights="fp8")]
    report = op_gate(registry.get(point, "fp8_scaled_mm"), workloads, seeds=(0,))
    assert report.passed, report.first_failure()


def test_a_point_without_an_activation_tolerance_refuses_quantized_activations(monkeypatch):
    import dataclasses

    monkeypatch.setattr(spec("experts"), "activation_tolerance", {})  # as a point nobody measured
    variant = dataclasses.replace(registry.get("experts", "torch"), name="quantizes", activations="fp8")
    report = op_gate(variant, [DECODE.with_(weights="fp8")], seeds=(0,))
    assert [c.name for c in report.failures] == ["tolerance"]
    assert "experts declares no tolerance for fp8 activations" in report.failures[0].detail


def test_declared_activation_quantization_buys_no_slack_on_other_weights():
    """The looser tolerance holds only on the format's own weights: on BF16 weights a variant that says it
    quantizes activations to FP8 is held to the reference's tolerance (it passes on FP8 weights)."""
    import dataclasses

    from beam_model.quant.formats import quantize_fp8

    def dense_mlp(x, w):  # per-token E4M3 activations, dequantized, on whatever weights it is given
        codes, scale = quantize_fp8(x)
        return registry.reference("dense_mlp").fn((codes.float() * scale).to(x.dtype), w)

    variant = dataclasses.replace(registry.reference("dense_mlp"), name="w16a8", fn=dense_mlp,
                                  formats=("bf16", "fp8"), activations="fp8")
    assert op_gate(variant, [PREFILL.with_(weights="fp8")], seeds=(0, 1)).passed
    report = op_gate(variant, [PREFILL], seeds=(0, 1))
    assert not report.passed and "accuracy" in {c.name for c in report.failures}
