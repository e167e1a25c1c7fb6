"""The gates themselves: planted faulty variants are rejected by the check meant to catch them, every
real CPU variant passes, the model gate accepts the reference and torch_compile builds and rejects a
planted one, and the point specs build inputs the way the gates rely on.

beam-tiny throughout. The op-gate workloads are decode b2 and a 2 x 20-token prefill: N = 2 and
N = 40, the model gate's decode and prompt sizes, so torch.compile reuses its graphs across tests.
"""

import json
import math

import pytest
import torch
import torch.utils.deterministic
from planted import PLANTED, planted

from workbench import registry
from workbench.gates import CheckResult, GateReport, capture_calls, model_gate, op_gate
from workbench.points import LAYER_DEPENDENT, Workload, leaves, spec
from workbench.registry import DRAFTER_POINTS, POINTS, Variant, reference, variants

DECODE = Workload(batch=2, context=1000)        # long context: SSMax and RoPE at large positions, windowed pages
PREFILL = Workload(batch=2, tokens_per_seq=20, context=100)  # a chunk after earlier context


def workloads(point, dtype="bf16"):
    kinds = ("sliding", "full") if point in LAYER_DEPENDENT else ("sliding",)
    return [w.with_(layer=k, dtype=dtype) for w in (DECODE, PREFILL) for k in kinds]


@pytest.fixture(scope="module")
def tiny_model():
    from beam_model.model import BeamForCausalLM

    return BeamForCausalLM.from_preset("beam-tiny", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def captured(tiny_model):
    ids = torch.randint(0, tiny_model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    return capture_calls(tiny_model, ids)


# ------------------------------------------------------------------ planted faults are rejected

@pytest.mark.parametrize("name", sorted(PLANTED))
def test_planted_variant_is_rejected(name):
    point, _, check = PLANTED[name]
    report = op_gate(planted(name), workloads(point), seeds=(0, 1))
    failed = {c.name for c in report.failures}
    assert not report.passed
    assert check in failed, f"{name} should fail {check!r}; failed {sorted(failed)}"


def test_stale_result_needs_the_fresh_inputs_check():
    # Right on every first look at a buffer: only re-filling the same tensors exposes it.
    report = op_gate(planted("stale_by_pointer"), workloads("attn_out"), seeds=(0,))
    assert {c.name for c in report.failures} == {"fresh_inputs"}


def test_crash_is_a_failed_check_with_the_error_text():
    report = op_gate(planted("decode_only"), [PREFILL], seeds=(0,))
    (runs,) = [c for c in report.checks if c.name == "runs"]
    assert not runs.passed and "prefill is not implemented" in runs.detail
    json.dumps(report.to_dict())  # lock files hold it


def test_gate_restores_global_torch_state():
    before = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    op_gate(planted("decode_only"), [PREFILL], seeds=(0,))
    op_gate(planted("partial_write"), [DECODE], seeds=(0,))
    assert (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory) == before


# ------------------------------------------------------------------ real variants pass

CPU_VARIANTS = [(p, name) for p in POINTS for name, v in variants(p).items() if v.backend in ("torch", "torch_compile")]


@pytest.mark.parametrize("point,name", CPU_VARIANTS, ids=[f"{p}:{n}" for p, n in CPU_VARIANTS])
def test_real_variant_passes(point, name, captured):
    report = op_gate(variants(point)[name], workloads(point), seeds=(0, 1), captured=captured)
    assert report.passed, [f"{c.name} [{c.case}] {c.error} {c.detail}" for c in report.failures]
    # the target's forward never samples and runs no drafter: nothing captured for those points
    assert any(c.case.startswith("captured:") for c in report.checks) or point == "sample" or point in DRAFTER_POINTS


def test_fp32_tolerances_hold_the_reference():
    for point in ("boundary", "experts", "attention"):
        assert op_gate(variants(point)["torch"], workloads(point, "fp32")[:1], seeds=(0,)).passed


# ------------------------------------------------------------------ captured activations

def test_capture_calls_keeps_both_layer_kinds_and_the_last_boundary(captured, tiny_model):
    c = tiny_model.config
    kinds = {call.workload.layer for call in captured["attention"]}
    assert kinds == {"sliding", "full"}
    assert [call.kwargs["window"] for call in captured["attention"]][:2] == [c.sliding_window, None]
    last = [call for call in captured["boundary"] if call.layer == c.num_hidden_layers - 1]
    assert any(call.args[2]["next_norm"] is None for call in last)
    assert captured["sample"] == []  # a forward never samples
    assert tiny_model.ops.attention is registry.get("attention", "torch").fn  # unwrapped again


# ------------------------------------------------------------------ model gate

def _errors(report):
    return {c.name: c.error for c in report.checks}


def test_model_gate_passes_reference_and_torch_compile():
    same = model_gate({}, dtype="bf16")
    assert same.passed and _errors(same)["prompt_logits"] == 0  # the gate adds no noise of its own
    everything = {p: "torch_compile" for p in POINTS}
    for dtype in ("bf16", "fp32"):  # BF16: the product's dtype; FP32: where the model gate is sharp
        report = model_gate(everything, dtype=dtype)
        assert report.passed, [f"{c.name} {c.error} {c.detail}" for c in report.failures]
    assert _errors(report)["prompt_logits"] < 1e-5


def test_model_gate_rejects_planted_build():
    table = registry.variants("attention")
    table["planted_window"] = planted("window_off_by_one")
    try:
        report = model_gate({"attention": "planted_window"}, dtype="fp32")
    finally:
        del table["planted_window"]
    assert not report.passed
    assert "prompt_logits" in {c.name for c in report.failures}


def test_model_gate_reports_a_build_that_cannot_bind():
    report = model_gate({"attention": "no_such_variant"}, dtype="fp32", decode_steps=1)
    assert not report.passed and "no_such_variant" in report.failures[0].detail


# ------------------------------------------------------------------ the specs the gates rely on

@pytest.mark.parametrize("point", POINTS)
def test_spec_layout_is_seed_independent(point):
    s = spec(point)
    w = workloads(point)[-1]
    a, b = s.make_inputs(w, "cpu", 0), s.make_inputs(w, "cpu", 1)
    shapes = lambda call: [(t.shape, t.dtype) for t in _tensors(call)]  # noqa: E731
    assert shapes(a) == shapes(b)
    assert s.bytes(w) > 0 and s.flops(w) > 0 and set(s.tolerance) == {"bf16", "fp16", "fp32"}


def _tensors(call):
    return [t for t in leaves(call) if isinstance(t, torch.Tensor)]


def test_attention_inputs_use_scattered_pages():
    q, cache, meta = spec("attention").make_inputs(Workload(batch=3, context=300, layer="full"), "cpu", 0).args
    pages = meta.page_table[0][meta.page_table[0] >= 0].tolist()
    assert len(pages) == 5 and any(b - a != 1 for a, b in zip(pages, pages[1:]))
    sliding = spec("attention").make_inputs(Workload(batch=1, context=1000, layer="sliding"), "cpu", 0).args[2]
    assert (sliding.page_table[0] == -1).any()  # pages out of the window are released, as in serving


def test_experts_bytes_count_only_the_experts_a_small_batch_touches():
    c = Workload().config
    one_expert = 3 * c.hidden_size * c.moe_intermediate_size * 2
    b1, big = Workload(batch=1), Workload(batch=64)
    assert spec("experts").bytes(b1) < (c.num_experts_per_tok + 1) * one_expert
    assert spec("experts").bytes(big) > c.n_routed_experts * one_expert


def test_gate_report_serialises():
    r = GateReport("op", "x:y")
    assert not r.passed  # no checks is no evidence
    r.checks.append(CheckResult("accuracy", "c", False, math.nan, 1e-2))
    assert json.loads(json.dumps(r.to_dict()))["checks"][0]["error"] == "nan"


def test_model_gate_on_a_built_model_restores_its_variants(tiny_model):
    report = model_gate(tiny_model, {"attn_out": "torch_compile"}, decode_steps=2)
    assert report.passed and report.first_failure() is None
    assert tiny_model.ops.selection["attn_out"] == "torch"


def test_op_gate_at_a_tuning_config():
    base = registry.get("attn_out", "torch")
    tuned = registry.Variant("attn_out", "tuned", "torch", base.fn,
                             configure=lambda cfg: planted("wrong_dtype").fn if cfg.get("bad") else base.fn)
    assert op_gate(tuned, [DECODE], seeds=(0,), config={"bad": False}).passed
    bad = op_gate(tuned, [DECODE], seeds=(0,), config={"bad": True})
    assert not bad.passed and bad.first_failure().startswith("signature")


def test_lock_gates_rerun_the_locked_points():
    from workbench.gates import lock_gates
    from workbench.lock import Lock

    points = {p: {"variant": "torch"} for p in POINTS}
    points["attn_out"] = {"variant": "torch_compile", "config": None}
    lock = Lock(model={"preset": "beam-tiny", "dtype": "bf16"}, target="decode-b1", environment={}, points=points)
    results = lock_gates(lock, device="cpu")
    assert set(results) == {"attn_out", "model"} and all(r["passed"] for r in results.values())


def test_model_gate_forces_routing_yet_checks_the_candidates_own():
    """The candidate's MoE layers use the reference's expert choice (teacher forcing), but a route
    variant that picks wrong experts on ragged batches only is still caught by the routing check."""
    def batched_wrong(x, w, *, n_group, topk_group, top_k, scale):
        ids, weights = reference("route").fn(x, w, n_group=n_group, topk_group=topk_group, top_k=top_k,
                                             scale=scale)
        return (ids + 1) % w["weight"].shape[0] if x.shape[0] > 1 else ids, weights

    table = registry.variants("route")
    table["planted_batched_wrong"] = Variant("route", "planted_batched_wrong", "torch", batched_wrong)
    try:
        report = model_gate({"route": "planted_batched_wrong"}, dtype="bf16")
    finally:
        del table["planted_batched_wrong"]
    assert [c.name for c in report.failures] == ["routing"], [c.name for c in report.failures]


def test_worst_element_scales_by_its_row_where_rows_differ_in_size():
    """Rows far above the output's RMS (a full-attention prefill's first tokens) are judged against
    their own RMS: an error that scales with its row, as rounding before a GEMM does, passes there
    (the bf16 reference itself failed the output-wide scale at 8K tokens, runs/gate-row-scale-tp8/);
    a wrong element in a large row, a dropped small row and a NaN still fail."""
    from workbench.gates import ELEMENT_FACTOR, _worst_element

    g = torch.Generator().manual_seed(0)
    row_scale = torch.full((256, 1), 0.01)
    row_scale[:2] = 1.0  # two rows ~11x the output's RMS
    ref = torch.randn(256, 512, generator=g) * row_scale
    limit = ELEMENT_FACTOR * spec("attention_out").tolerance["bf16"]
    rounding = 2.0 ** -8 * row_scale * torch.randn(256, 512, generator=g)  # ~1 bf16 ulp of the row
    output_rms = ref.square().mean().sqrt()
    assert (rounding.abs() / (ref.abs() + output_rms)).max() > limit, "the output-wide scale rejects it: the premise"
    assert _worst_element(ref + rounding, ref)[0] < limit / 2

    wrong = ref.clone()
    wrong[1, 7] += 0.5
    row_rms = ref[1].square().mean().sqrt().item()
    assert _worst_element(wrong, ref) == (pytest.approx(0.5 / (ref[1, 7].abs().item() + row_rms)), (1, 7))
    assert _worst_element(wrong, ref)[0] > limit
    dropped = ref.clone()
    dropped[100] = 0.0
    error, where = _worst_element(dropped, ref)
    assert error > limit and where[0] == 100
    nan = ref.clone()
    nan[3, 3] = math.nan
    assert math.isnan(_worst_element(nan, ref)[0])
    flat = ref.flatten()  # one dimension: the output's RMS alone
    expected = (1.0 / (flat.abs() + flat.square().mean().sqrt())).max().item()
    assert _worst_element(flat + 1.0, flat)[0] == pytest.approx(expected)


def test_one_wrong_vector_in_a_large_output_fails_its_worst_element():
    """At 8 x 2048 tokens one wrong 16-byte vector moves the output's relative error (a norm) by less
    than the tolerance; its worst element is far outside ELEMENT_FACTOR x the tolerance."""
    big = Workload(batch=8, tokens_per_seq=2048, context=0, dtype="bf16")
    report = op_gate(planted("one_vector_wrong"), [big], seeds=(0,))
    accuracy = [c for c in report.checks if c.name == "accuracy" and "output 0" in c.detail]
    norm, element = [c for c in accuracy if "worst element" not in c.detail], \
        [c for c in accuracy if "worst element" in c.detail]
    assert norm and all(c.passed for c in norm), "the norm alone would not see it: this test's premise"
    assert element and not any(c.passed for c in element)
    assert all(c.error > 10 * c.threshold for c in element)
    assert "[16383, " in element[0].detail  # the last token row: where it is wrong
