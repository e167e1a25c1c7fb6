"""The per-point search (workbench/search.py): which candidates are tried, how the noise band is set,
and when a point's result kept in the run folder is reused."""

import dataclasses
import json

import pytest
import torch
from harness_helpers import tiny_runner

from workbench.targets import for_device, get_target


def test_backends_filter_leaves_candidates_out_and_keys_the_cache(tmp_path):
    from workbench.registry import get, variants
    from workbench.search import Search
    from workbench.search_results import PointResult

    runner = tiny_runner()
    calls = {"qkvg_proj": {"sliding": 5, "full": 2}}
    only = Search(runner, calls=calls, out_dir=str(tmp_path), backends=("torch_compile",))
    every = Search(runner, calls=calls, out_dir=str(tmp_path))
    workloads = only.workloads("qkvg_proj")
    assert "left out" in only._unavailable(get("qkvg_proj", "packed"), workloads)
    assert only._unavailable(get("qkvg_proj", "torch_compile"), workloads) is None
    assert every._unavailable(get("qkvg_proj", "packed"), workloads) is None
    assert only.fingerprint("qkvg_proj") != every.fingerprint("qkvg_proj")  # no reuse across filters
    again = Search(runner, calls=calls, out_dir=str(tmp_path), backends=("torch_compile",))
    saved = PointResult("qkvg_proj", "torch_compile", None, 10.0, 8.0, 0.02, [])
    only._save("qkvg_proj", saved)  # a filtered run resumes from its own cache (JSON lists vs tuples)
    assert again._load("qkvg_proj") == saved and every._load("qkvg_proj") is None
    backends = {v.backend for v in variants("qkvg_proj").values()}
    untouched = Search(runner, calls=calls, out_dir=str(tmp_path), backends=tuple(backends | {"cute"}))
    assert untouched.fingerprint("qkvg_proj") == every.fingerprint("qkvg_proj")  # filters nothing here


def test_a_point_blind_to_the_layer_kind_is_timed_once_for_all_its_calls():
    from workbench.search import ALL_LAYERS, Search

    runner = tiny_runner()
    calls = {"experts": {"sliding": 3, "full": 2}, "attention": {"sliding": 5, "full": 2}, "head": {"sliding": 1}}
    search = Search(runner, calls=calls, out_dir="unused")
    assert search.step_calls("experts") == {ALL_LAYERS: 5} and list(search.workloads("experts")) == [ALL_LAYERS]
    assert search.step_calls("attention") == calls["attention"]  # window, cache group: per kind
    assert {k: w.layer for k, w in search.workloads("attention").items()} == {"sliding": "sliding", "full": "full"}
    assert search.step_calls("head") == {"sliding": 1}


def test_head_and_sample_are_timed_on_each_prompts_last_token():
    """A prefill step runs head and sample on each sequence's last new token (the profiler's "model"
    calls), not at one row per prompt token (16384 rows at prefill-8x2k), a workload the step never runs."""
    from beam_model import BeamForCausalLM
    from workbench.profiler.attribution import profile_step
    from workbench.search import Search
    from workbench.targets import StepRunner

    model = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32)
    target = for_device(get_target("prefill-8x2k"), model.device)
    assert target.tokens_per_seq > 1
    calls = {p.point: p.calls_by_kind for p in profile_step(StepRunner(model, target)).points}
    assert calls["head"] == calls["sample"] == {"model": 1}
    search = Search(StepRunner(model, target), calls=calls, out_dir="unused")
    for point in ("head", "sample"):
        (workload,) = search.workloads(point).values()
        assert workload.tokens == target.batch
    (experts,) = search.workloads("experts").values()
    assert experts.tokens == target.batch * target.tokens_per_seq
    full = get_target("prefill-8x2k").workload("beam-501b-tp8", "bf16", "model")
    assert full.tokens == 8 and full.context == 2048


def test_a_verify_step_runs_head_and_sample_on_every_token():
    """verify-b1 (speculative decoding's step): 16 tokens of one sequence, logits and a draw at each."""
    from beam_model import BeamForCausalLM
    from workbench.search import Search
    from workbench.targets import StepRunner

    model = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32)
    target = for_device(get_target("verify-b1"), model.device)
    assert (target.batch, target.tokens_per_seq, target.all_logits) == (1, 16, True)
    runner = StepRunner(model, target)
    assert runner().shape == (16,)
    search = Search(runner, calls={"head": {"model": 1}, "experts": {"sliding": 5}}, out_dir="unused")
    (head,) = search.workloads("head").values()
    (experts,) = search.workloads("experts").values()
    assert head.tokens == experts.tokens == 16
    assert get_target("verify-b8").workload("beam-501b-tp8", "bf16", "model").tokens == 128


def test_a_verify_step_feeds_its_block_as_decode_rows_and_computes_the_prefill_chunks_logits():
    """The engine's graphed verify step feeds each of the block's tokens as a decode row of its sequence:
    the target does so too, and its rows see what a chunk of the same tokens sees (FP32)."""
    from beam_model import BeamForCausalLM
    from workbench.registry import get
    from workbench.targets import StepRunner

    model = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32)
    target = for_device(get_target("verify-b8"), model.device)
    rows = StepRunner(model, target)
    kinds = lambda runner: {m.decode for m in runner.step.groups.values()}  # noqa: E731
    assert kinds(rows) == {True} and rows.step.num_tokens == target.batch * target.tokens_per_seq
    assert target.workload("beam-tiny", "fp32", "sliding").tokens_per_seq == 1  # decode-shaped calls
    chunk = StepRunner(model, dataclasses.replace(target, decode_rows=False))
    assert kinds(chunk) == {False}
    # both are built from seed 0: the same history, tokens and pages
    assert torch.equal(rows.input_ids, chunk.input_ids)
    with torch.inference_mode():
        logits = [model.step(r.input_ids, r.cache, r.step, all_logits=True) for r in (rows, chunk)]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)  # FP32 sums in another order
    # the block's kernels run as the engine's verify graphs run them: programmatic dependent launch off where a
    # kernel reads the KV cache (the block's keys are written by the same step), on elsewhere
    attention = get("attention", "triton").configs[0]
    rows.rebind({"boundary": "triton", "attention": "triton"},
                {"boundary": {"num_warps": 4, "pdl": True}, "attention": {**attention, "pdl": True}})
    assert model.ops.configs == {"boundary": {"num_warps": 4, "pdl": True}, "attention": attention}
    rows.rebind(None)


def _noisy_search(tmp_path, reference_us: list[float]):
    """A boundary search on beam-tiny whose reference times read `reference_us` in turn and whose only
    candidate (Triton, gate passed) times 100 us: what the search decides from those timings."""
    from workbench.search import Search
    from workbench.search_results import CandidateResult

    runner = tiny_runner()
    search = Search(runner, calls={"boundary": {"sliding": 2}}, out_dir=str(tmp_path), backends=("triton",))
    timings = iter(reference_us)
    search._step_time = lambda v, config, workloads: {"step_us": next(timings), "spread": 0.01, "recompiles": 0}
    search._try = lambda v, config, workloads, ref_us: CandidateResult(
        v.point, v.name, v.backend, config, True, step_us=100.0, spread=0.01, speedup=ref_us / 100.0)
    return search, timings


def test_one_slow_reference_timing_does_not_set_the_noise_band(tmp_path):
    """Two timings of the experts reference ~2x apart would set a band of 0.99 and keep a 10x faster
    kernel out. Timings are added until two agree within MAX_BAND; those two give the reference time and
    the band."""
    from workbench.noise import MAX_BAND, MIN_BAND

    search, left = _noisy_search(tmp_path, [2844.0, 1430.0, 1440.0, 999.0])
    result = search.search_point("boundary")
    assert result.choice == "triton" and result.reference_us == 1430.0
    assert result.band == pytest.approx(10 / 1430) or result.band == MIN_BAND
    assert next(left) == 999.0  # a third timing agreed with the second: no fourth
    noisy, left = _noisy_search(tmp_path / "noisy", [100.0, 150.0, 230.0, 400.0, 1.0])
    result = noisy.search_point("boundary")
    assert result.band == MAX_BAND and result.reference_us == 100.0 and next(left) == 1.0  # capped, 4 timings
    assert result.choice == "torch"  # 100 us is no gain on a reference of 100 us


def test_a_candidate_timed_past_the_noisy_spread_is_timed_again(tmp_path):
    """A config timed at 2.5x its time with a 28-35% spread (something besides it ran) would be chosen or
    dropped by noise: such a candidate is timed once more after the others, and the quieter timing stands
    (noisier: kept)."""
    from workbench.registry import get
    from workbench.search import NOISY_SPREAD, Search
    from workbench.search_results import CandidateResult

    configs = [repr(c) for c in get("boundary", "triton").tuning_configs()]
    assert len(configs) >= 3
    first = {configs[0]: (250.0, 0.3), configs[1]: (100.0, 0.01), configs[2]: (90.0, NOISY_SPREAD * 3)}
    again = {configs[0]: (80.0, 0.02), configs[2]: (50.0, NOISY_SPREAD * 4)}
    retimed = []

    def step_time(v, config, workloads):
        if v.name == "torch":
            return {"step_us": 1000.0, "spread": 0.01, "recompiles": 0}
        retimed.append(repr(config))
        us, spread = again[repr(config)]
        return {"step_us": us, "spread": spread, "recompiles": 0}

    def tried(v, config, workloads, ref_us):
        us, spread = first.get(repr(config), (120.0, 0.01))
        return CandidateResult(v.point, v.name, v.backend, config, True, step_us=us, spread=spread, speedup=ref_us / us)

    search = Search(tiny_runner(), calls={"boundary": {"sliding": 2}}, out_dir=str(tmp_path), backends=("triton",))
    search._step_time, search._try = step_time, tried
    result = search.search_point("boundary")
    assert retimed == [configs[0], configs[2]]  # only the two past NOISY_SPREAD, after all the others
    assert repr(result.config) == configs[0] and result.choice_us == 80.0
    noisy = result.candidate("triton", eval(configs[0]))
    assert noisy.noisy_timing == {"step_us": 250.0, "spread": 0.3} and noisy.spread == 0.02
    kept = result.candidate("triton", eval(configs[2]))  # its second timing was noisier: the first stands
    assert kept.step_us == 90.0 and kept.noisy_timing is None
    assert Search(tiny_runner(), calls={"boundary": {"sliding": 2}}, out_dir=str(tmp_path),
                  backends=("triton",))._load("boundary").candidate("triton", eval(configs[0])).noisy_timing
    from rich.console import Console

    from workbench.events import CandidateRetimed
    from workbench.progress import ConsoleProgress

    console = Console(record=True, width=200)
    ConsoleProgress(console).event(CandidateRetimed("boundary", noisy))
    assert "timed again (30.0% spread at 250.0):       80.0 us/step  spread 2.0%" in console.export_text()


def test_a_config_that_does_not_run_as_itself_is_skipped_with_its_reason(tmp_path, monkeypatch):
    """A variant's `config_supports` declines a tuning config at the target's shapes: the search
    records that candidate as skipped with the reason and never times it."""
    from workbench.registry import get

    search, _ = _noisy_search(tmp_path, [1000.0, 1000.0])
    triton = get("boundary", "triton")
    declined = triton.configs[0]
    monkeypatch.setattr(triton, "config_supports", lambda config, wl: "planted" if config == declined else True)
    tried = []
    real_try = search._try
    search._try = lambda v, config, workloads, ref_us: tried.append(config) or real_try(v, config, workloads, ref_us)
    rows = [c for c in search.search_point("boundary").candidates if c.variant == "triton"]
    assert declined not in tried and len(tried) == len(triton.configs) - 1
    assert [c.skipped for c in rows if c.config == declined] == ["planted"]


def test_a_cached_result_with_a_band_past_the_cap_is_searched_again(tmp_path):
    """Results cached under the old two-timing rule with a band past MAX_BAND may hide a winner."""
    from workbench.noise import MAX_BAND
    from workbench.search_results import PointResult

    search, _ = _noisy_search(tmp_path, [])
    search._save("boundary", PointResult("boundary", "torch", None, 2844.0, 2844.0, 0.99, []))
    assert search._load("boundary") is None
    search._save("boundary", PointResult("boundary", "torch", None, 2844.0, 2844.0, MAX_BAND, []))
    assert search._load("boundary") is not None


def test_a_result_searched_without_a_library_is_searched_again_once_it_is_installed(tmp_path, monkeypatch):
    """A point searched while CuTe DSL (or FlashInfer) was missing never tried its variants: once the
    library is there, the cached result is not reused; while it is still missing, it is."""
    from workbench import search as searchmod
    from workbench.search_results import PointResult

    search, _ = _noisy_search(tmp_path, [])
    real = searchmod.backend_available
    monkeypatch.setattr(searchmod, "backend_available",
                        lambda b: (False, "not installed") if b == "cute" else real(b))
    search._save("boundary", PointResult("boundary", "torch", None, 10.0, 10.0, 0.02, []))
    assert search._load("boundary") is not None
    monkeypatch.setattr(searchmod, "backend_available", lambda b: (True, "ok") if b == "cute" else real(b))
    assert search._load("boundary") is None


def test_a_result_cached_under_older_gates_has_its_choice_gated_again(tmp_path, monkeypatch):
    """A check added to the gates (GATE_VERSION) reaches cached results: the choice is gated again
    before reuse (once: the file then carries the version); if it fails now the point is searched
    again. The reference needs no gate."""
    from workbench import gates
    from workbench.search_results import CandidateResult, PointResult

    search, _ = _noisy_search(tmp_path, [1000.0, 1000.0])
    gated, verdict = [], {"passed": True}

    class Report:
        def __init__(self):
            self.passed = verdict["passed"]

        def to_dict(self):
            return {"gate": "op", "passed": self.passed, "regated": True}

    monkeypatch.setattr(gates, "op_gate", lambda v, wls, **kw: gated.append((v.name, kw["config"])) or Report())
    chosen = CandidateResult("boundary", "triton", "triton", {"num_warps": 4}, True, step_us=50.0)
    old = PointResult("boundary", "triton", {"num_warps": 4}, 100.0, 50.0, 0.02, [chosen])
    search._save("boundary", old)
    with open(search.folder.search_result("boundary")) as f:
        saved = json.load(f)
    del saved["gate_version"]  # as written before GATE_VERSION
    with open(search.folder.search_result("boundary"), "w") as f:
        json.dump(saved, f)
    result = search.search_point("boundary")
    assert gated == [("triton", {"num_warps": 4})] and result.choice == "triton"
    assert result.candidates[0].gate["regated"]
    search.search_point("boundary")
    assert len(gated) == 1  # the file now carries the version
    with open(search.folder.search_result("boundary")) as f:
        saved = json.load(f)
    saved["gate_version"] = gates.GATE_VERSION - 1
    with open(search.folder.search_result("boundary"), "w") as f:
        json.dump(saved, f)
    verdict["passed"] = False
    result = search.search_point("boundary")  # searched again: the stubbed timings pick triton at 100 us
    assert len(gated) == 2 and result.reference_us == 1000.0


def test_a_result_cached_under_older_gates_has_its_gate_failures_gated_again(tmp_path, monkeypatch):
    """A check relaxed since a result was cached (GATE_VERSION) may pass a candidate the older gates
    failed, which was never timed: it is gated again, and if it passes now the point is searched again;
    a failure that still fails leaves the cached result in use. Skipped candidates were never gated."""
    from workbench import gates
    from workbench.search_results import CandidateResult, PointResult

    search, _ = _noisy_search(tmp_path, [1000.0, 1000.0])
    gated, passes = [], set()

    class Report:
        def __init__(self, name):
            self.passed = name in passes

        def to_dict(self):
            return {"gate": "op", "passed": self.passed}

    monkeypatch.setattr(gates, "op_gate", lambda v, wls, **kw: gated.append(v.name) or Report(v.name))
    failed = CandidateResult("boundary", "triton", "triton", {"num_warps": 4}, False, failed_check="accuracy")
    skipped = CandidateResult("boundary", "cute", "cute", None, False, skipped="needs a CUDA GPU")

    def cache_under_older_gates():
        search._save("boundary", PointResult("boundary", "torch", None, 100.0, 100.0, 0.02, [failed, skipped]))
        with open(search.folder.search_result("boundary")) as f:
            saved = json.load(f)
        saved["gate_version"] = gates.GATE_VERSION - 1
        with open(search.folder.search_result("boundary"), "w") as f:
            json.dump(saved, f)

    cache_under_older_gates()
    result = search.search_point("boundary")
    assert gated == ["triton"] and result.reference_us == 100.0  # still fails: the cached result stands
    cache_under_older_gates()
    passes.add("triton")
    result = search.search_point("boundary")  # searched again: the stubbed timings time the reference at 1000 us
    assert gated[:2] == ["triton", "triton"] and result.reference_us == 1000.0
