"""The end-to-end stage: the per-point choices timed and gated together, in the target's whole step.

`EndToEnd.finalize` takes the per-point search's results and
1. gates the chosen set with the model gate (a ragged prefill and decode; the op gate saw the
   target's shapes only), dropping each choice that fails it alone;
2. times the reference build and the chosen set (the target's step, graph-replayed as the server
   runs it);
3. tries in the step each candidate that timed faster than its point's choice but within the op
   band (the incumbent keeps a tie) by at least CHALLENGE_SHARE of the step: it replaces the choice
   if a paired timing finds the step faster with it beyond its band and the set passes the model gate
   (a launch property such as PDL overlaps a kernel with the one before it, which an op timed alone
   barely shows);
4. reverts each choice alone; those whose reversal stays within the step's noise (`step_band`), and
   those whose op-level gain is too small to show in the step at all (their reversal beyond the band
   can only be drift), are dropped together, unless a paired timing (`time_paired`: the set with and without them in
   alternating rounds, so a drift of the device falls on both sides of each round's ratio) finds the
   set faster with them beyond its band.
Each build's timing and gate goes into a journal as it is made, so a stage ended midway resumes
without making them again (`journal`, `save`). Once the agent has had a candidate accepted, the builds
are timed by a `timer` that runs the step in a process of its own (`workbench.agent.step_sandbox`);
the model gate stays here, where the candidate runs in its sandbox.

What it must never do: write the lock or the report (`workbench.optimize` does), time a build in
another way than `timing.time_fn` on the target's step (or its timer's), or keep a set that fails the model gate.
"""

from __future__ import annotations

import json
from typing import Callable

from workbench import gates, timing
from workbench.events import Challenged, DroppedAsNoise, ModelGateDropped, PairedTimed, Reverted
from workbench.noise import MIN_STEP_BAND, paired_gain, step_band
from workbench.registry import REFERENCE
from workbench.search_results import CandidateResult, PointResult

# Seconds of samples per build timed end to end: a 0.3 s prefill step gets 20 (at 2 s, its 6 samples'
# spread set a 3% band), a decode step the default 50, a 5 s reference step 5.
STEP_SAMPLES_S = 6.0
# The paired timing that decides a drop: rounds of both builds, each a short time_fn (a prefill step:
# 2 warm-up calls and 5 timed, ~1.7 s; a decode step: its graph captured again, 10 + 50 replays).
PAIRED_ROUNDS = 10
PAIRED_ROUND_S = 0.5
# A candidate tied with a point's choice at the op level is tried end to end when it saved at least
# this share of the step there: less could not show above the paired band.
CHALLENGE_SHARE = MIN_STEP_BAND / 2
# The version of this stage's rule, part of end_to_end.json's key: a stage result made under another
# rule is made again. Raise it when the rule changes.
FINALIZE_RULE = 5


class EndToEnd:
    def __init__(self, runner, *, on_event: Callable[[object], None] | None = None,
                 step_samples_s: float = STEP_SAMPLES_S):
        """`runner`: the target's step (`targets.StepRunner`), rebound to each build it times, unless
        `timer` is set (an object with this class's `time_build`): then the timer times every build.
        `step_samples_s`: seconds of samples a build's timing takes; a paired timing's round takes at most
        PAIRED_ROUND_S and its rounds together no more than one build's timing."""
        self.runner, self.model, self.device = runner, runner.model, runner.model.device
        self.on_event = on_event or (lambda e: None)
        self.timer = None
        self.step_samples_s = step_samples_s
        self.paired_round_s = min(PAIRED_ROUND_S, step_samples_s / PAIRED_ROUNDS)

    def time_build(self, selection: dict[str, str], configs: dict[str, dict] | None = None, *,
                   compile_mode: str | None = None, budget_s: float | None = None, **timing_kw) -> dict:
        """The step with `selection` bound, timed by `timing.time_fn` (`timing_kw` go to it) for `budget_s`
        seconds (default: `step_samples_s`)."""
        budget_s = self.step_samples_s if budget_s is None else budget_s
        if self.timer is not None:
            return self.timer.time_build(selection, configs, compile_mode=compile_mode, budget_s=budget_s,
                                         **timing_kw)
        self.runner.rebind(selection, configs, compile_mode=compile_mode)
        return {**timing.time_fn(self.runner, device=self.device, budget_s=budget_s, **timing_kw),
                "process": timing.PROCESS_ID}

    def time_paired(self, a: tuple[dict, dict], b: tuple[dict, dict]) -> dict:
        """Builds a and b, each (selection, configs), timed in PAIRED_ROUNDS alternating rounds (a b, b a,
        ...): how much slower b is than a (`gain`, the median of the rounds' b / a - 1) and its noise
        band (`paired_gain`). Two builds timed minutes apart differ by the device's drift, as much as
        several small choices save together; within a round both see the same device."""
        rounds, seconds = [], self.paired_round_s
        for i in range(PAIRED_ROUNDS):
            first, second = (a, b) if i % 2 == 0 else (b, a)
            # the round's budget also bounds the reps time_call adds while the spread is wide (2 s)
            t1, t2 = (self.time_build(*build, budget_s=seconds, max_seconds=seconds)["median_us"]
                      for build in (first, second))
            rounds.append([t1, t2] if i % 2 == 0 else [t2, t1])
        return {**paired_gain(rounds), "process": timing.PROCESS_ID}

    def drop_model_gate_failures(self, chosen: dict, configs: dict, recorded: _Recorded | None = None):
        """The op gate saw the target's shapes only; the model gate runs a ragged prefill and decode.
        If the chosen set fails it, each choice is gated alone and those that fail are dropped (from
        `chosen` and `configs`). Returns the passing report of the set as given, or None when choices
        were gated alone."""
        recorded = recorded or _Recorded(self, {}, lambda: None)
        report = recorded.gate(chosen, configs)
        if report.passed:
            return report
        for point in list(chosen):
            alone = recorded.gate({point: chosen[point]}, {point: configs.get(point)})
            if not alone.passed:
                self.on_event(ModelGateDropped(point, chosen.pop(point), alone.first_failure()))
                configs.pop(point, None)
        return None

    def finalize(self, results: dict[str, PointResult], journal: dict | None = None,
                 save: Callable[[], None] = lambda: None) -> dict:
        """Time the chosen set end to end, gate it, try candidates tied with a choice at the op level
        end to end, and drop choices that do not help the step (the module's docstring says how).
        Each build's timing and gate goes into `journal` as it is made (then `save()`), and one found
        there is read back instead of made again."""
        recorded = _Recorded(self, {} if journal is None else journal, save)
        chosen = {p: r.choice for p, r in results.items() if r.choice != REFERENCE}
        configs = {p: r.config for p, r in results.items() if r.config and p in chosen}
        gated = dict(chosen)
        gate = self.drop_model_gate_failures(chosen, configs, recorded)
        gated_configs = dict(configs)
        reference = recorded.timing({}, {})
        # A set that is the reference is the reference build: timing it twice would report noise as a speed-up
        locked = recorded.timing(chosen, configs) if chosen else reference
        challenges = {}
        for point, r in results.items():
            c = _challenger(r, locked["median_us"])
            if c is None or point not in chosen and r.choice != REFERENCE:  # dropped at the model gate
                continue
            others = {p: v for p, v in chosen.items() if p != point}
            trial = {**others, **({} if c.variant == REFERENCE else {point: c.variant})}
            trial_configs = {**_of(configs, others), **({point: c.config} if c.config else {})}
            challenge = {"variant": c.variant, "config": c.config, "op_us": c.step_us, "choice_op_us": r.choice_us}
            trial_gate = recorded.gate(trial, trial_configs)
            if not trial_gate.passed:
                challenge.update(won=False, model_gate=trial_gate.first_failure())
            else:  # gain: how much slower the step is with the choice than with the challenger
                challenge.update(recorded.paired((trial, trial_configs), (chosen, configs)))
                challenge["won"] = challenge["gain"] > challenge["band"]
            challenges[point] = challenge
            self.on_event(Challenged(point=point, **challenge))
            if challenge["won"]:
                chosen, configs = trial, trial_configs
        if any(c["won"] for c in challenges.values()):
            locked = recorded.timing(chosen, configs) if chosen else reference
        band = step_band(locked)
        reverted, reverted_process = {}, {}
        for point in chosen:  # each choice reverted alone, against the whole chosen set
            trial = {p: v for p, v in chosen.items() if p != point}
            timed = recorded.timing(trial, _of(configs, trial))
            reverted[point], reverted_process[point] = timed["median_us"], timed.get("process")
            self.on_event(Reverted(point, reverted[point], locked["median_us"]))
        # Choices whose reversal is within the step's noise may not help: they go, all together, unless a
        # paired timing shows the set with them faster than without beyond its band. Dropped one by one
        # against the shrinking set, each drop's noise would add up; judged by two builds timed apart,
        # the device's drift between them would decide.
        # A reversal beyond the band is believed only from a choice whose op-level gain could show in the
        # step: for the others, two builds timed apart differ by the device's drift as much, and a no-gain
        # choice on a small point would be locked by one run and dropped by the next.
        expected = {p: _expected_gain(results.get(p), chosen[p], challenges.get(p)) for p in chosen}
        idle = [p for p in chosen if reverted[p] <= locked["median_us"] * (1 + band)
                or expected[p] < band * locked["median_us"]]
        dropped, before_drop, paired = {}, None, None
        if idle:
            kept = {p: v for p, v in chosen.items() if p not in idle}
            paired = {"choices": {p: chosen[p] for p in idle},
                      **recorded.paired((chosen, configs), (kept, _of(configs, kept)))}
            paired["kept"] = paired["gain"] > paired["band"]
            self.on_event(PairedTimed(**paired))
            if not paired["kept"]:
                without = recorded.timing(kept, _of(configs, kept)) if kept else reference
                dropped, before_drop = paired["choices"], locked
                self.on_event(DroppedAsNoise(dropped, band, locked["median_us"], without["median_us"]))
                chosen, configs, locked = kept, _of(configs, kept), without
        if gate is None or chosen != gated or configs != gated_configs:  # the set changed since it passed
            gate = recorded.gate(chosen, configs)
        if not gate.passed:
            raise RuntimeError(f"the chosen build fails the model gate: {gate.first_failure()}")
        if self.timer is None:  # the timer's builds run in its own process
            self.runner.rebind(chosen, configs)
        return {"selection": chosen, "configs": configs, "reference": reference, "locked": locked,
                "reverted_us": reverted, "reverted_process": reverted_process, "model_gate": gate.to_dict(),
                "band": band, "dropped": dropped, "before_drop": before_drop, "paired": paired,
                "challenges": challenges, "expected_gain_us": expected}


def _challenger(r: PointResult, step_us: float) -> CandidateResult | None:
    """The point's fastest gated candidate, when it is not the choice and timed faster than it by at
    least CHALLENGE_SHARE of the step (the incumbent kept it out as within the op band)."""
    timed = [c for c in r.candidates if c.gate_passed and c.step_us is not None and not c.skipped]
    best = min(timed, key=lambda c: c.step_us, default=None)
    if best is None or (best.variant, best.config or None) == (r.choice, r.config or None):
        return None
    return best if r.choice_us - best.step_us >= CHALLENGE_SHARE * step_us else None


def _expected_gain(r: PointResult | None, variant: str, challenge: dict | None) -> float:
    """What the choice saves the step at the op level (the reference's time less its own, per step)."""
    if r is None:
        return 0.0
    own = challenge["op_us"] if challenge and challenge.get("won") and challenge["variant"] == variant else r.choice_us
    return max(r.reference_us - own, 0.0)


def _of(configs: dict, selection: dict) -> dict:
    return {p: c for p, c in configs.items() if p in selection}


def _timing(saved) -> dict:
    """A journaled build timing, or KeyError / TypeError when it is not one."""
    float(saved["median_us"]), float(saved["spread"]), int(saved["reps"])
    return dict(saved)


def _paired(saved) -> dict:
    """A journaled paired timing (its gain and band made again from its rounds), or an error."""
    if len(saved["rounds"]) != PAIRED_ROUNDS:
        raise ValueError("a paired timing cut short")
    return {**paired_gain([[float(a), float(b)] for a, b in saved["rounds"]]), "process": saved.get("process")}


class _Recorded:
    """The stage's builds (timings and model gates), each made once per journal: a build found in it,
    keyed by its selection and configs, is read back, any other is made and recorded."""

    def __init__(self, stage: EndToEnd, journal: dict, save: Callable[[], None]):
        self.stage, self.journal, self.save = stage, journal, save

    def _get(self, what: str, builds: list[tuple[dict, dict]], make, dump, load):
        key = json.dumps([what, *(x for selection, configs in builds
                                  for x in (selection, {p: configs.get(p) for p in sorted(selection)}))],
                         sort_keys=True, default=str)
        if key in self.journal:
            try:
                return load(self.journal[key])
            except (TypeError, ValueError, KeyError):  # an entry edited or cut short: made again
                pass
        made = make()
        self.journal[key] = dump(made)
        self.save()
        return made

    def timing(self, selection: dict, configs: dict) -> dict:
        return self._get("timing", [(selection, configs)], lambda: self.stage.time_build(selection, configs),
                         dict, _timing)

    def paired(self, a: tuple[dict, dict], b: tuple[dict, dict]) -> dict:
        return self._get("paired", [a, b], lambda: self.stage.time_paired(a, b), dict, _paired)

    def gate(self, selection: dict, configs: dict):
        return self._get("model_gate", [(selection, configs)],
                         lambda: gates.model_gate(self.stage.model, selection, configs=configs),
                         lambda report: report.to_dict(), gates.GateReport.from_dict)
