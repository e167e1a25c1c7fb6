"""A candidate in its sandbox keeps what it declares: the weight formats it reads and the format it quantizes
activations to. An agent's W8A8 variant is gated, and re-checked while timed, at its point's FP8-activation
tolerance on FP8 weights, as the package's are; one that declares neither is refused on them."""

from workbench.agent.sandbox import Sandbox
from workbench.gates import op_gate
from workbench.points import Workload

W8A8 = '''
import torch

from beam_model.quant.formats import quantize_fp8
from workbench.registry import register
from workbench.variants.kernels.fp8_scaled_mm import fp8_gemm


@register("dense_mlp", "{name}", "torch"{declared})
def dense_mlp(x, w):  # the three GEMMs on E4M3 rows quantized per token by the PyTorch rule
    g = fp8_gemm(*quantize_fp8(x), w["gate_proj"], x.dtype).float()
    u = fp8_gemm(*quantize_fp8(x), w["up_proj"], x.dtype).float()
    return fp8_gemm(*quantize_fp8((torch.nn.functional.silu(g) * u).to(x.dtype)), w["down_proj"], x.dtype)
'''
FP8_PREFILL = Workload(batch=2, tokens_per_seq=9, context=20, weights="fp8")


def _sandboxed(tmp_path, name: str, declared: str) -> Sandbox:
    path = tmp_path / f"dense_mlp__{name}.py"
    path.write_text(W8A8.format(name=name, declared=declared))
    return Sandbox("dense_mlp", name, file=str(path), static_check=False)


def test_a_sandboxed_w8a8_candidate_is_gated_at_its_declared_tolerance(tmp_path):
    with _sandboxed(tmp_path, "agent_w8a8", ', formats=("fp8",), activations="fp8"') as box:
        variant = box.variant()
        assert variant.formats == ("fp8",) and variant.activations == "fp8"
        report = op_gate(variant, [FP8_PREFILL], seeds=(0,))
    assert report.passed, report.first_failure()


def test_a_sandboxed_candidate_that_declares_nothing_is_refused_on_fp8_weights(tmp_path):
    with _sandboxed(tmp_path, "agent_silent", "") as box:
        variant = box.variant()
    assert variant.formats == ("bf16",) and variant.activations is None
    assert "fp8" in variant.unsupported(FP8_PREFILL)


def test_a_w8a8_candidates_timed_calls_are_rechecked_at_its_declared_tolerance(tmp_path):
    """The judge re-checks a sample of the timed outputs; a W8A8 candidate's are held to the tolerance its
    gate used (the BF16 one would reject every honest per-token rounding)."""
    import random

    import torch

    from workbench.agent.judge import sandboxed_timing

    timing = {"copies": 2, "warmup": 0, "min_reps": 2, "max_seconds": 0.0}
    with _sandboxed(tmp_path, "agent_w8a8", ', formats=("fp8",), activations="fp8"') as box:
        _, recheck = sandboxed_timing({"candidate": box}, FP8_PREFILL, device=torch.device("cpu"), rng=random.Random(0),
                                      timing=timing)
    assert recheck["checked"] > 0 and recheck["failed"] == [], recheck
