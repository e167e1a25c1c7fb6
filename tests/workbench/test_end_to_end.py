"""The end-to-end stage (workbench/end_to_end.py): the chosen set gated and timed in the whole step,
ties at the op level tried there, choices within the step's noise dropped only by a paired timing, and
a stage ended midway resumed from its journal."""

import json

import pytest
from harness_helpers import tiny_runner


def test_a_choice_failing_the_model_gate_is_dropped_not_locked():
    """The op gate sees the target's decode shapes only; a kernel with no prefill path passes it,
    then fails the model gate's ragged prefill: finalize drops that choice and keeps the others."""
    from planted import planted

    from workbench import registry
    from workbench.end_to_end import EndToEnd
    from workbench.events import ModelGateDropped

    runner = tiny_runner()
    events = []
    stage = EndToEnd(runner, on_event=events.append)
    table = registry.variants("attention")
    table["planted_decode_only"] = planted("decode_only")
    try:
        chosen, configs = {"attention": "planted_decode_only", "qkvg_proj": "packed"}, {}
        stage.drop_model_gate_failures(chosen, configs)
    finally:
        del table["planted_decode_only"]
    assert chosen == {"qkvg_proj": "packed"}
    assert [(e.point, e.variant) for e in events if isinstance(e, ModelGateDropped)] == \
        [("attention", "planted_decode_only")]


def test_a_locked_set_that_is_the_reference_reports_the_reference_time():
    """When nothing beats the reference end to end, the locked build is the reference build: one
    timing, speed-up 1.00x, never two timings of the same build whose noise reads as a slow-down."""
    from workbench.end_to_end import EndToEnd
    from workbench.search_results import PointResult

    runner = tiny_runner()
    stage = EndToEnd(runner)
    timed = []
    stage.time_build = lambda selection, configs=None, **kw: timed.append(dict(selection)) or \
        {"median_us": 100.0 + len(timed), "spread": 0.01, "reps": 50}
    final = stage.finalize({"boundary": PointResult("boundary", "torch", None, 5.0, 5.0, 0.02, [])})
    assert timed == [{}] and final["locked"] is final["reference"] and final["selection"] == {}


def test_a_choice_stays_when_reverting_it_slows_the_step_beyond_the_steps_noise(monkeypatch):
    """A choice whose reversal slows a 3.57 ms decode step by 1.3% at a 0.25% spread over 50 reps stays:
    the op- level 2% minimum is not a whole step's noise. The step's band comes from its spread and reps:
    the same 1.3% from 6 reps with a 5% spread is within it, and then the paired timing decides: noise
    when its rounds scatter as widely; a 0.06% gain is noise at any spread."""
    import random

    from workbench import gates
    from workbench.end_to_end import PAIRED_ROUND_S, EndToEnd
    from workbench.noise import MIN_STEP_BAND, step_band
    from workbench.search_results import PointResult

    class Passing:
        passed = True

        def to_dict(self):
            return {"gate": "model", "passed": True}

    monkeypatch.setattr(gates, "model_gate", lambda *a, **kw: Passing())
    stage = EndToEnd(tiny_runner())
    saves = {"dense_mlp": 48.0, "head": 2.0}  # us of the step each choice saves
    spread = {"spread": 0.0025, "reps": 50}
    scatter = random.Random(0)

    def time_build(selection, configs=None, budget_s=None, **kw):
        us = 3572.0 + sum(us for p, us in saves.items() if p not in selection)
        if budget_s == PAIRED_ROUND_S:  # a paired round scatters as the step's spread says
            us *= 1 + scatter.gauss(0.0, spread["spread"] / 2.56)
        return {"median_us": us, **spread}

    stage.time_build = time_build
    results = {p: PointResult(p, "triton", None, 10.0 + us, 10.0, 0.02, []) for p, us in saves.items()}
    assert step_band(spread) == MIN_STEP_BAND
    assert stage.finalize(results)["selection"] == {"dense_mlp": "triton"}
    spread.update(spread=0.05, reps=6)
    assert step_band(spread) > 48.0 / 3572.0
    final = stage.finalize(results)
    assert final["selection"] == {} and final["paired"]["band"] > 50.0 / 3572.0


def test_choices_each_within_the_noise_go_only_if_the_step_without_them_all_stays_within_it(monkeypatch):
    """Choices dropped one by one, each within the step's band of the set before it, can add up to a
    slower step (docs/decisions.md #12-13). Each choice is reverted alone against the whole set; those
    within the band go together, and only if the step without all of them still times within the band."""
    from workbench import gates
    from workbench.end_to_end import EndToEnd
    from workbench.noise import step_band
    from workbench.search_results import PointResult

    passing = gates.GateReport("model", "set", [gates.CheckResult("logits", "prefill", True, 0.0, 1.0)])
    monkeypatch.setattr(gates, "model_gate", lambda *a, **kw: passing)
    stage = EndToEnd(tiny_runner())
    timing = {"spread": 0.0025, "reps": 50}
    assert 3572.0 * step_band(timing) == pytest.approx(17.86)

    def finalize(saves):
        stage.time_build = lambda selection, configs=None, **kw: {
            "median_us": 3572.0 + sum(us for p, us in saves.items() if p not in selection), **timing}
        return stage.finalize({p: PointResult(p, "triton", None, 10.0 + us, 10.0, 0.02, []) for p, us in saves.items()})

    kept = finalize({"dense_mlp": 10.0, "head": 10.0, "sample": 10.0})
    assert kept["selection"] == {"dense_mlp": "triton", "head": "triton", "sample": "triton"}  # 30 us together
    assert kept["dropped"] == {} and kept["before_drop"] is None
    final = finalize({"dense_mlp": 5.0, "head": 5.0, "sample": 5.0, "route": 40.0})
    assert final["selection"] == {"route": "triton"} and final["locked"]["median_us"] == 3587.0
    # the report keeps what went and the whole chosen set's time before it went
    assert final["dropped"] == {"dense_mlp": "triton", "head": "triton", "sample": "triton"}
    assert final["before_drop"]["median_us"] == 3572.0 and final["band"] == step_band(timing)
    # the paired timing of the set with and without them (15 us of 3572, under its 0.5% floor) decided it
    assert final["paired"]["gain"] == pytest.approx(15.0 / 3572.0) and not final["paired"]["kept"]
    assert kept["paired"]["gain"] == pytest.approx(30.0 / 3572.0) and kept["paired"]["kept"]
    from workbench.report import noise_line
    line = noise_line({"dropped": final["dropped"], "step_band": final["band"], "locked_ms": 3.587,
                       "before_drop_ms": 3.572, "paired": final["paired"]})
    assert line == ("Dropped at the end-to-end stage, each reverted within the step's noise band (0.5%): "
                    "dense_mlp:triton, head:triton, sample:triton; in a paired timing (10 alternating rounds) the "
                    "set without them was 0.42% slower, band 0.50%; the chosen set with them timed 3.572 ms, "
                    "the locked set without them 3.587 ms.")
    assert noise_line({"dropped": {}, "step_band": kept["band"], "paired": kept["paired"]}) == (
        "Kept at the end-to-end stage, each reverted within the step's noise band (0.5%): dense_mlp:triton, "
        "head:triton, sample:triton; in a paired timing (10 alternating rounds) the set without them was 0.84% "
        "slower, band 0.50%.")
    assert noise_line({"dropped": {}, "paired": None}) is None


def test_a_paired_timing_keeps_choices_worth_more_together_than_its_band_when_builds_timed_apart_drift(
        monkeypatch):
    """Choices that each revert within a prefill step's 1.8% band may still be worth ~1% together, as much
    as two builds timed minutes apart drift. The drop is decided by the two builds timed in alternating
    rounds, whose ratios cancel a steady drift. Here every timing runs 0.1% slower than the one before:
    the choices, worth 1.2% of the step together, stay; worth 0.3%, they still go."""
    from workbench import gates
    from workbench.end_to_end import PAIRED_ROUNDS, EndToEnd
    from workbench.search_results import PointResult

    passing = gates.GateReport("model", "set", [gates.CheckResult("logits", "prefill", True, 0.0, 1.0)])
    monkeypatch.setattr(gates, "model_gate", lambda *a, **kw: passing)
    stage = EndToEnd(tiny_runner())
    calls = []

    def finalize(saves):
        def time_build(selection, configs=None, **kw):
            calls.append(sorted(selection))
            us = 234600.0 + sum(s for p, s in saves.items() if p not in selection)
            return {"median_us": us * (1 + 0.001 * len(calls)), "spread": 0.045, "reps": 26}

        calls.clear()
        stage.time_build = time_build
        return stage.finalize({p: PointResult(p, "triton", None, 10.0 + us, 10.0, 0.02, []) for p, us in saves.items()})

    saves = {"experts": 2e6, "qkvg_proj": 2000.0, "dense_mlp": 900.0}
    final = finalize(saves)
    assert final["band"] > 0.018 and final["paired"]["choices"] == {"qkvg_proj": "triton", "dense_mlp": "triton"}
    assert final["selection"] == {p: "triton" for p in saves} and final["dropped"] == {}
    assert final["paired"]["kept"] and final["paired"]["gain"] == pytest.approx(2900.0 / 234600.0, rel=0.1)
    # the paired rounds alternate which build goes first: with, without; without, with; ...
    paired = calls[-2 * PAIRED_ROUNDS:]
    with_them, without = sorted(saves), ["experts"]
    assert paired[:4] == [with_them, without, without, with_them] and len(final["paired"]["rounds"]) == PAIRED_ROUNDS
    assert final["locked"]["median_us"] < 234600.0 * 1.01  # the chosen set's own timing, not a paired round's

    final = finalize({"experts": 2e6, "qkvg_proj": 400.0, "dense_mlp": 300.0})
    assert final["selection"] == {"experts": "triton"} and not final["paired"]["kept"]
    assert final["dropped"] == {"qkvg_proj": "triton", "dense_mlp": "triton"}


def test_a_candidate_tied_with_the_choice_at_the_op_level_is_tried_end_to_end(monkeypatch):
    """experts:triton_rows' PDL twin timed 21 us a step faster alone, within the op band, so the incumbent
    would stay; in the decode step it makes the step 5.2% faster (a PDL launch overlaps the kernel before
    it, which an op timed alone barely shows). Such a candidate, faster by at least CHALLENGE_SHARE of the
    step, is tried end to end in a paired timing and taken only if the step is faster with it beyond the
    band and the set passes the model gate; smaller ties (head's 0.4 us here) are not tried."""
    from workbench import gates
    from workbench.end_to_end import CHALLENGE_SHARE, EndToEnd
    from workbench.report import challenge_lines, locked_point_us
    from workbench.search_results import CandidateResult, PointResult

    def cand(point, variant, config, us):
        return CandidateResult(point, variant, "triton", config, True, step_us=us)

    plain, pdl = {"BLOCK_N": 1}, {"BLOCK_N": 1, "pdl": True}
    results = {
        "experts": PointResult("experts", "triton_rows", plain, 5063.9, 1397.9, 0.02, [
            cand("experts", "torch", None, 5063.9), cand("experts", "triton_rows", plain, 1397.9),
            cand("experts", "triton_rows", pdl, 1376.7)]),
        "head": PointResult("head", "triton", None, 70.0, 46.3, 0.02, [
            cand("head", "torch", None, 70.0), cand("head", "triton", None, 46.3),
            cand("head", "triton", {"pdl": True}, 45.9)])}
    assert (1397.9 - 1376.7) / 3036.0 > CHALLENGE_SHARE > (46.3 - 45.9) / 3036.0
    failing = set()

    def model_gate(model, selection, configs=None, **kw):
        ok = not any((configs or {}).get(p, {}).get("pdl") for p in failing)
        return gates.GateReport("model", "set", [gates.CheckResult("logits", "decode", ok, 0.0, 1.0)])

    monkeypatch.setattr(gates, "model_gate", model_gate)
    stage = EndToEnd(tiny_runner())

    def finalize(pdl_saves):
        def time_build(selection, configs=None, **kw):
            us = 3036.0 + (3000.0 if "experts" not in selection else 0.0) + (25.0 if "head" not in selection else 0.0)
            us -= pdl_saves if (configs or {}).get("experts", {}).get("pdl") else 0.0
            return {"median_us": us, "spread": 0.0025, "reps": 50}

        stage.time_build = time_build
        return stage.finalize(results)

    final = finalize(148.0)
    assert final["selection"] == {"experts": "triton_rows", "head": "triton"} and final["configs"] == {"experts": pdl}
    assert list(final["challenges"]) == ["experts"] and final["challenges"]["experts"]["won"]
    assert final["challenges"]["experts"]["gain"] == pytest.approx(148.0 / (3036.0 - 148.0))
    assert final["locked"]["median_us"] == 3036.0 - 148.0  # the set with the challenger, timed again
    assert final["reverted_us"]["experts"] == 3036.0 + 3000.0  # reversals are against the new set
    assert locked_point_us(results["experts"], "triton_rows", pdl) == 1376.7
    assert challenge_lines({"challenges": final["challenges"]}) == [
        'Tried end to end, tied with the choice at the op level: experts:triton_rows {"BLOCK_N": 1, "pdl": true} '
        "(1376.7 us/step against the choice's 1397.9): with the choice the step was 5.12% slower in 10 paired "
        "rounds (band 0.50%): taken."]

    final = finalize(3.0)  # no better end to end than its 0.1%: the choice stays
    assert final["configs"] == {"experts": plain} and not final["challenges"]["experts"]["won"]
    assert final["locked"]["median_us"] == 3036.0

    failing.add("experts")  # faster, but the set with it fails the model gate
    final = finalize(148.0)
    assert final["configs"] == {"experts": plain} and "gain" not in final["challenges"]["experts"]
    line, = challenge_lines({"challenges": final["challenges"]})
    assert f"fails the model gate in the set ({final['challenges']['experts']['model_gate']}), not taken." in line
    assert final["challenges"]["experts"]["model_gate"]


def test_an_end_to_end_stage_ended_midway_resumes_from_its_journal(monkeypatch):
    """At prefill-8x2k the end-to-end stage outlasts one device command, and a stage ended midway would
    lose the builds it timed. Each build's timing and gate is journaled as it is made: a finalize ended
    midway and resumed times only the builds it had not made, and decides as one uninterrupted run does."""
    from workbench import gates
    from workbench.end_to_end import PAIRED_ROUNDS, EndToEnd
    from workbench.search_results import PointResult

    gated = []
    passing = gates.GateReport("model", "set", [gates.CheckResult("logits", "prefill", True, float("nan"), 1.0)])
    monkeypatch.setattr(gates, "model_gate", lambda *a, **kw: gated.append(1) or passing)
    stage = EndToEnd(tiny_runner())
    saves = {"dense_mlp": 48.0, "head": 2.0, "route": 30.0}  # head's 2 us are noise: dropped, re-timed
    timed, limit = [], [None]

    def time_build(selection, configs=None, **kw):
        if len(timed) == limit[0]:
            raise TimeoutError("the command's time limit")
        timed.append(sorted(selection))
        return {"median_us": 3572.0 + sum(us for p, us in saves.items() if p not in selection),
                "spread": 0.0025, "reps": 50}

    stage.time_build = time_build
    results = {p: PointResult(p, "triton", {"BLOCK": 64}, 10.0 + us, 10.0, 0.02, []) for p, us in saves.items()}
    whole = stage.finalize(results)
    builds = list(timed)
    # reference, all three, each reverted, then the paired rounds of the set with and without head; the
    # set without head is the head-reverted build, not timed again
    assert whole["selection"] == {"dense_mlp": "triton", "route": "triton"}
    assert len(builds) == 5 + 2 * PAIRED_ROUNDS

    journal, saves_made = {}, []
    timed.clear(), gated.clear()
    limit[0] = 3
    with pytest.raises(TimeoutError):
        stage.finalize(results, journal=journal, save=lambda: saves_made.append(len(journal)))
    assert saves_made == [1, 2, 3, 4] and gated == [1]  # the gate, then three timings, each saved
    timed.clear(), gated.clear()
    limit[0] = None
    resumed = stage.finalize(results, journal=json.loads(json.dumps(journal)))
    assert timed == builds[3:] and gated == [1]  # the set as locked is gated at the end, as before
    assert resumed["selection"] == whole["selection"] and resumed["reverted_us"] == whole["reverted_us"]
    assert resumed["model_gate"] == passing.to_dict()
    assert gates.GateReport.from_dict(passing.to_dict()).to_dict() == passing.to_dict()
    # an entry edited or cut short is made again, not trusted
    broken = json.loads(json.dumps(journal))
    timings = [k for k in broken if k.startswith('["timing"')]
    broken[timings[0]], broken[timings[1]] = "garbled", {"median_us": 1.0}
    gate_key = next(k for k in broken if k.startswith('["model_gate"'))
    broken[gate_key] = {"gate": "model"}
    timed.clear(), gated.clear()
    again = stage.finalize(results, journal=broken)
    assert timed == builds[:2] + builds[3:] and gated == [1, 1]
    assert again["selection"] == whole["selection"]
    # so is a paired timing cut short; the journal's builds are reused around it
    done = json.loads(json.dumps(broken))
    paired_key = next(k for k in done if k.startswith('["paired"'))
    done[paired_key]["rounds"] = done[paired_key]["rounds"][:3]
    timed.clear()
    assert stage.finalize(results, journal=done)["paired"]["rounds"] == whole["paired"]["rounds"]
    assert timed == builds[5:]


def test_a_choice_whose_op_gain_cannot_show_in_the_step_must_win_a_paired_timing(monkeypatch):
    """A no-gain choice on a small point (0.5 us at the op level of a 3.57 ms step) whose reversal was
    timed 30 us slower by drift between builds timed apart: believed alone it would be locked in one run
    and dropped in the next. Its op gain is under the step's band, so the paired timing decides, where
    both builds see the same device: it goes. The large choice, confirmed by its op gain, stays."""
    from workbench import gates
    from workbench.end_to_end import PAIRED_ROUND_S, EndToEnd
    from workbench.search_results import PointResult

    passing = gates.GateReport("model", "set", [gates.CheckResult("logits", "prefill", True, 0.0, 1.0)])
    monkeypatch.setattr(gates, "model_gate", lambda *a, **kw: passing)
    stage = EndToEnd(tiny_runner())

    def time_build(selection, configs=None, budget_s=None, **kw):
        us = 3572.0 + (48.0 if "dense_mlp" not in selection else 0.0)
        drift = 30.0 if budget_s != PAIRED_ROUND_S and selection == {"dense_mlp": "triton"} else 0.0
        return {"median_us": us + drift, "spread": 0.0025, "reps": 50}

    stage.time_build = time_build
    final = stage.finalize({"dense_mlp": PointResult("dense_mlp", "triton", None, 58.0, 10.0, 0.02, []),
                            "head": PointResult("head", "triton", None, 10.5, 10.0, 0.02, [])})
    assert final["reverted_us"]["head"] == 3602.0  # beyond the band (17.9 us) unpaired
    assert final["selection"] == {"dense_mlp": "triton"} and final["dropped"] == {"head": "triton"}
    assert final["expected_gain_us"] == {"dense_mlp": 48.0, "head": 0.5}
