"""The search loop: gate and time every candidate variant per fusion point, keep what really helps.

Order: points ranked by what they could save (step time above their roofline floor). Per point,
every available variant that is not quarantined on this device (workbench/quarantine.py) and each of
its tuning configs passes the op gate first, then is timed at the shapes the target calls it with,
weighted by how often one step calls it; it replaces the incumbent only if faster beyond the noise
band (from repeated timings of the reference). Per-point results are cached as JSON under the run
folder, keyed by the variants' source hashes, so a stopped run resumes where it was (a point is
searched again once a backend library that was missing then is installed, and a result cached under
older gates has its choice and its gate failures gated again before it is reused). A candidate that hangs
or kills the process (a JIT build that never ends, a kernel that faults) costs one run, not the
search: the candidate in flight is recorded in `search/<point>.inflight` before it runs and cleared
after, and a watchdog ends the process (exit code EXIT_STALLED) when one candidate runs past
`candidate_timeout` seconds, not counting compilers it runs (`watchdog.py`); a resumed run skips,
with the reason, every variant with a candidate recorded there (its other tuning configs run the
same code), except one the run was stopped in from outside (Ctrl-C, a time limit), tried again once.
Then the chosen set is timed end to end (the target's graph-replayed step) and must pass the model
gate. Where a candidate timed faster than a point's choice but within the band (the incumbent keeps a
tie) by at least CHALLENGE_SHARE of the step, the step decides: it replaces the choice if a paired
timing finds the step faster with it beyond its band (a launch property such as PDL overlaps a kernel
with the one before it, which an op timed alone barely shows). Then choices whose reversal alone does
not slow the step beyond the step's own noise (`step_band`) are dropped together, unless the set with
them beats the set without them beyond the noise of a paired timing (`time_paired`: the two builds
timed in alternating rounds, so a drift of the device between builds timed minutes apart falls on
both sides of each round's ratio). Each build of this stage is journaled as it is made, so a stage
ended midway resumes. Progress goes to an `on_event`
callback (CLI progress, TUI). This module never writes the lock or the report (`workbench.optimize`
does) and never edits variants.
"""

from __future__ import annotations

import faulthandler
import functools
import json
import os
import statistics
import sys
import threading
import time
import types
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

from workbench import bench, gates
from workbench.lock import code_key, code_key_matches, source_hash
from workbench.points import LAYER_DEPENDENT
from workbench.quarantine import quarantined
from workbench.registry import COMPOUNDS, REFERENCE, Variant, backend_available, relaid_members, split_of, variants
from workbench.watchdog import Watchdog

STALLED = "did not finish in an earlier run of this search"  # a skip reason's mark: the candidate hung
ALL_LAYERS = "all"  # the kind standing for every layer kind of a point whose inputs ignore it
MIN_BAND = 0.02  # never trust a speed-up smaller than 2%, however quiet the machine looked
MAX_BAND = 0.10  # reference timings further apart than this measured something besides the op
REFERENCE_TIMINGS = 4  # at most, while no two of them agree within MAX_BAND
# A candidate timed with a wider spread measured something besides it (a decode search on the H200
# timed eleven configs at 2.5x their time with 28-35% spreads: runs/optimize-decode-b1-beam-501b-tp8/
# NOTES.md, session 29): it is timed again once the point's other candidates are done
NOISY_SPREAD = MAX_BAND
# A whole step times far steadier than one op: spreads of 0.1-1.6% on the H200 (the builds in
# runs/optimize-*-beam-501b-tp8/end_to_end.json), where the op-level MIN_BAND dropped choices worth 1-3%.
MIN_STEP_BAND = 0.005
# Seconds of samples per build timed end to end: a 0.3 s prefill step gets 20 (at 2 s: 6, whose
# spread set a 3% band, session 10), a decode step the default 50, a 5 s reference step 5.
STEP_SAMPLES_S = 6.0
# The paired timing that decides a drop: rounds of both builds, each a short time_fn (a prefill step:
# 2 warm-up calls and 5 timed, ~1.7 s; a decode step: its graph captured again, 10 + 50 replays).
PAIRED_ROUNDS = 10
PAIRED_ROUND_S = 0.5
# A candidate tied with a point's choice at the op level is tried end to end when it saved at least
# this share of the step there: less could not show above the paired band (decode-b1, session 26:
# experts' PDL config, 21 us faster a step alone and within the 2% band, made the step 5.2% faster,
# runs/optimize-decode-b1-beam-501b-tp8/session26-rejected/swap-experts-pdl.json).
CHALLENGE_SHARE = MIN_STEP_BAND / 2
# The end-to-end stage's rule; a run folder's end_to_end.json made under another is made again.
# 3: the drop of choices within the noise is decided by a paired timing (2: by two builds timed apart).
# 4: a candidate tied with a choice at the op level (CHALLENGE_SHARE) is tried end to end first.
FINALIZE_RULE = 4
EXIT_STALLED = 5  # the process exit code when the watchdog ends a stalled candidate
# A candidate in flight when the run was stopped from outside (Ctrl-C; the CLI turns a time limit's
# SIGTERM into the same) did not hang: the next run tries it again, as a FlashInfer JIT build cut off
# by a device command's limit needs (runs/optimize-prefill-8x2k-beam-501b-tp8/README.md, session 30).
# One stopped in this many runs is skipped like a hung one (a build longer than any command).
STOPS_TRIED = 2


@dataclass
class CandidateResult:
    point: str
    variant: str
    backend: str
    config: dict | None
    gate_passed: bool
    failed_check: str | None = None
    step_us: float | None = None      # this point's time per target step with the candidate
    spread: float | None = None
    speedup: float | None = None      # vs the reference, same run
    skipped: str | None = None        # why it was not tried here
    gate: dict = field(default_factory=dict)
    seconds: float | None = None      # wall time of its gate + timing (first-use JIT builds included)
    compile_s: float | None = None    # of which compilers it started were seen running (`watchdog.py`)
    noisy_timing: dict | None = None  # {"step_us", "spread"} of a first timing past NOISY_SPREAD, replaced


@dataclass
class PointResult:
    point: str
    choice: str
    config: dict | None
    reference_us: float
    choice_us: float
    band: float
    candidates: list[CandidateResult]

    def to_dict(self) -> dict:
        return asdict(self)

    def candidate(self, variant: str, config: dict | None) -> CandidateResult | None:
        """The candidate of `variant` at `config`: each config of a variant is gated and timed apart."""
        return next((c for c in self.candidates if c.variant == variant and (c.config or None) == (config or None)),
                    None)

    @classmethod
    def from_dict(cls, d: dict) -> "PointResult":
        return cls(**{**d, "candidates": [CandidateResult(**c) for c in d["candidates"]]})


class Search:
    def __init__(self, runner, *, calls: dict[str, dict[str, int]], out_dir: str, seeds=(0, 1),
                 on_event: Callable[[dict], None] | None = None, trust: bool = False,
                 backends: tuple[str, ...] | None = None, candidate_timeout: float | None = None,
                 on_stall: Callable[[dict], None] | None = None):
        """`calls[point][kind]`: how often one step calls the point in "sliding"/"full" layers;
        `backends`: try only candidates of these backends (None: all); `candidate_timeout`: seconds
        one candidate's gate + timing may take before `on_stall(candidate)` (default: say so and
        end the process, since a thread stuck in a kernel or a compiler cannot be interrupted)."""
        self.runner, self.calls, self.out_dir, self.seeds = runner, calls, out_dir, seeds
        self.backends = tuple(sorted(backends)) if backends else None
        self.model = runner.model
        self.device = self.model.device
        self.dtype = str(self.model.dtype).replace("torch.", "").replace("bfloat16", "bf16") \
            .replace("float32", "fp32").replace("float16", "fp16")
        self.on_event = on_event or (lambda e: None)
        self.trust = trust
        self.skip = set()             # points the user asked to skip (TUI)
        self.resume = threading.Event()
        self.resume.set()             # cleared = paused between candidates
        self.candidate_timeout = candidate_timeout
        self.on_stall = on_stall or _end_process
        self.choices: dict[str, tuple[str, dict | None]] = {}  # point -> (variant, config) chosen so far

    # ---- per point ---------------------------------------------------------------------
    def step_calls(self, point: str) -> dict[str, int]:
        """Calls per step by the kinds `workloads` returns: a point whose inputs do not depend on the
        layer kind is gated and timed once for all its calls (same shapes, same values), not per kind."""
        calls = self.calls[point]
        return dict(calls) if point in LAYER_DEPENDENT or len(calls) < 2 else {ALL_LAYERS: sum(calls.values())}

    def workloads(self, point: str) -> dict[str, object]:
        preset = self.model.config.preset
        return {kind: self.runner.target.workload(preset, self.dtype, "sliding" if kind == ALL_LAYERS else kind)
                for kind in self.step_calls(point)}

    def _cache_file(self, point: str) -> str:
        return os.path.join(self.out_dir, "search", f"{point}.json")

    def _fingerprint(self, point: str) -> dict:
        """What a cached result depends on, as it reads back from JSON (a tuple would never equal its list)."""
        table = variants(point)
        # What was not tried (--backends, quarantine) keys the result, whatever the reason: a point that
        # leaves nothing out reuses an unfiltered run's result, and a lifted quarantine searches again.
        left_out = sorted(name for name, v in table.items() if name != REFERENCE and self._left_out(v))
        key = {"target": self.runner.target.name, "preset": self.model.config.preset, "dtype": self.dtype,
               "device": str(self.device.type), "calls": self.calls[point],
               "workloads": {kind: w.label() for kind, w in self.workloads(point).items()},
               "sources": {name: source_hash(point, name) for name in table},
               **({"members": self._member_choices(point)} if point in COMPOUNDS else {}),
               **({"left_out": left_out} if left_out else {})}
        return json.loads(json.dumps(key))

    def _step_time(self, variant, config, workloads) -> dict:
        """Median time one step spends in this point with this candidate, and the spread."""
        total, spread, recompiles = 0.0, 0.0, 0
        calls = self.step_calls(variant.point)
        for kind, workload in workloads.items():
            t = bench.time_variant(variant, workload, device=self.device, config=config)
            total += calls[kind] * t["median_us"]
            spread, recompiles = max(spread, t["spread"]), recompiles + t["recompiles"]
        return {"step_us": total, "spread": spread, "recompiles": recompiles}

    def cached(self, point: str) -> bool:
        """Whether this point's result is in the run folder and still valid (resuming costs nothing)."""
        return self._load(point) is not None

    def search_point(self, point: str) -> PointResult:
        cached = self._load(point)
        if cached and self._gated_again(point, cached):
            self.choices[point] = (cached.choice, cached.config)
            self.on_event({"type": "point_cached", "point": point, "result": cached.to_dict()})
            return cached
        self.on_event({"type": "point_start", "point": point})
        workloads = self.workloads(point)
        table = variants(point)
        ref = table[REFERENCE]
        ref_us, band, spread = self._reference_time(ref, workloads)
        best = CandidateResult(point, REFERENCE, ref.backend, None, True, step_us=ref_us,
                               spread=spread, speedup=1.0)
        if point in COMPOUNDS:  # the incumbent is no fusion: the members' choices, one after the other
            apart = self._step_time(self._members_apart(point), None, workloads)
            best = replace(best, step_us=apart["step_us"], spread=apart["spread"], speedup=ref_us / apart["step_us"])
        results = [best]
        fingerprint = self._fingerprint(point)
        unfinished = self._inflight(point, fingerprint)  # candidates that earlier processes never finished
        stalled = self._stalled_before(point, fingerprint)
        for name, v in table.items():
            if name == REFERENCE:
                continue
            why = self._unavailable(v, workloads) or self._relaid_members(point)
            for config in ([None] if why else v.tuning_configs()):  # an unavailable variant: one row
                self.resume.wait()  # paused: a skip asked meanwhile applies before the next candidate
                if point in self.skip:
                    break
                stuck = None if why else _stuck(unfinished, name)
                skipped = why or _config_unsupported(v, config, workloads) or stalled.get(name) or (
                    stuck is not None and (
                        f"{name} {stuck['config'] or ''} {STALLED} (the process "
                        f"hung, crashed or was stopped in it), so none of its configs is tried; delete "
                        f"{self._inflight_file(point)} to try again"))
                result = CandidateResult(point, name, v.backend, config, False, skipped=skipped) if skipped else \
                    self._watched(v, config, workloads, ref_us, fingerprint, unfinished)
                results.append(result)
                self.on_event({"type": "candidate", "point": point, "result": asdict(result)})
        if point not in self.skip:
            self._retime_noisy(table, results[1:], workloads, ref_us)
        for result in results[1:]:  # in order: a candidate replaces the best so far beyond the band only
            if result.step_us is not None and result.step_us < best.step_us * (1 - band):
                best = result
        out = PointResult(point, best.variant, best.config, ref_us, best.step_us, band, results)
        self.choices[point] = (out.choice, out.config)
        if point not in self.skip:  # a skipped point was not searched: a resumed run searches it
            self._save(point, out)
            if os.path.exists(self._inflight_file(point)):
                os.remove(self._inflight_file(point))
        self.on_event({"type": "point_done", "point": point, "result": out.to_dict()})
        return out

    def _retime_noisy(self, table, results, workloads, ref_us):
        """Time each candidate whose spread was past NOISY_SPREAD once more; the quieter timing stands."""
        for r in results:
            if r.step_us is None or r.spread is None or r.spread <= NOISY_SPREAD:
                continue
            self.resume.wait()
            t = self._step_time(table[r.variant], r.config, workloads)
            if not t["recompiles"] and t["spread"] < r.spread:
                r.noisy_timing = {"step_us": r.step_us, "spread": r.spread}
                r.step_us, r.spread, r.speedup = t["step_us"], t["spread"], ref_us / t["step_us"]
                self.on_event({"type": "candidate_retimed", "point": r.point, "result": asdict(r)})

    def _members_apart(self, point: str) -> Variant:
        """A compound as a build without it runs: its split over each member's choice in this search
        (the model's bound variant for a member not searched here)."""
        members, layouts = {}, []
        for m, (name, config) in self._member_choices(point).items():
            members[m] = variants(m)[name].at(config)
            layouts += [variants(m)[name].prepare] if variants(m)[name].prepare else []
        # the compound's weights are its members' (attention_out: attn_out's), laid out as the member's
        # choice lays them out in the model
        return Variant(point, REFERENCE, "torch", functools.partial(split_of(point), types.SimpleNamespace(**members)),
                       prepare=layouts[0] if len(layouts) == 1 else None)

    def _relaid_members(self, point: str) -> str | None:
        """Why a compound's fusions cannot run beside its members' choices (see `registry.Ops`), or None."""
        if point not in COMPOUNDS:
            return None
        relaid = relaid_members(point, {m: variants(m)[name] for m, (name, _) in self._member_choices(point).items()})
        return f"{', '.join(v.qualname for v in relaid)} re-lays its weights at load time, which a fusion of " \
            f"{point} cannot take" if relaid else None

    def _member_choices(self, point: str) -> dict[str, tuple[str, dict | None]]:
        ops = self.model.ops
        return {m: self.choices.get(m, (ops.variants[m].name, ops.configs.get(m))) for m in COMPOUNDS[point]}

    def _reference_time(self, ref, workloads) -> tuple[float, float, float]:
        """The reference's step time, the noise band and its spread. The reference is timed until two
        timings agree within MAX_BAND (REFERENCE_TIMINGS at most); the closest two give the time (the
        faster) and the band (their gap, within [MIN_BAND, MAX_BAND]). One timing slowed by something
        besides the op (allocator growth, clocks) would otherwise set the band: a 99% band once kept a
        12x faster experts kernel out of a prefill search."""
        timings = [self._step_time(ref, None, workloads) for _ in range(2)]
        while True:
            gap, pair = min(((_gap(a["step_us"], b["step_us"]), (a, b))
                             for i, a in enumerate(timings) for b in timings[i + 1:]), key=lambda g: g[0])
            if gap <= MAX_BAND or len(timings) >= REFERENCE_TIMINGS:
                break
            timings.append(self._step_time(ref, None, workloads))
        fast = min(pair, key=lambda t: t["step_us"])
        return fast["step_us"], bounded_band(gap), fast["spread"]

    def _gated_again(self, point: str, result: PointResult) -> bool:
        """Whether a cached result may be reused under the current gates. One cached under an older
        GATE_VERSION has the candidates those gates failed gated again first: one that passes now (a
        check was relaxed) was never timed, so the point is searched again. Then its choice: if it
        fails now (a check was added), the point is searched again. The verdicts of the other
        candidates that passed stay as recorded: only the choice is locked."""
        with open(self._cache_file(point)) as f:
            if json.load(f).get("gate_version") == gates.GATE_VERSION:
                return True
        table = variants(point)
        failed = [c for c in result.candidates
                  if not c.gate_passed and not c.skipped and c.variant in table and c.variant != result.choice]
        for c in failed:
            if self._regate(point, table[c.variant], c.config, was_failed=True).passed:
                return False
        if result.choice != REFERENCE:
            report = self._regate(point, table[result.choice], result.config, was_failed=False)
            if not report.passed:
                return False
            chosen = result.candidate(result.choice, result.config)
            if chosen is not None:
                chosen.gate = report.to_dict()
        self._save(point, result)
        return True

    def _regate(self, point: str, v, config, *, was_failed: bool):
        report = gates.op_gate(v, list(self.workloads(point).values()), device=self.device, seeds=self.seeds,
                               config=config)
        self.on_event({"type": "regated", "point": point, "variant": v.name, "config": config,
                       "was_failed": was_failed, "passed": report.passed})
        return report

    def _left_out(self, v) -> str | None:
        """Why the search does not try a variant that may well run here: --backends, or quarantine."""
        if self.backends and v.backend not in self.backends:
            return f"backend {v.backend!r} left out (--backends {' '.join(self.backends)})"
        return quarantined(v.point, v.name, self.device)

    def _unavailable(self, v, workloads) -> str | None:
        """Why a variant is not tried at these shapes, or None."""
        return self._left_out(v) or next((r for r in (v.unsupported(w, self.device) for w in workloads.values())
                                          if r), None)

    # ---- candidates that never finish ----------------------------------------------------
    def _inflight_file(self, point: str) -> str:
        return os.path.join(self.out_dir, "search", f"{point}.inflight")  # JSON, not *.json: no point result

    def _inflight(self, point: str, fingerprint: dict) -> list[dict]:
        """Candidates started and never finished by some process of this search (same fingerprint)."""
        try:
            with open(self._inflight_file(point)) as f:
                saved = json.load(f)
        except (OSError, ValueError):
            return []
        return saved["candidates"] if saved.get("fingerprint") == fingerprint else []

    def _stalled_before(self, point: str, fingerprint: dict) -> dict[str, str]:
        """Variants that never finished in the last search of this point at the same shapes and whose
        code has not changed since (its source hash, or its `code_key`: config lists aside): the point
        is searched again because another variant changed, and trying them again would cost the same
        hang (e.g. a torch.compile of the grouped MoE at prefill that ran past the watchdog)."""
        try:
            with open(self._cache_file(point)) as f:
                saved = json.load(f)
            old, candidates = saved["fingerprint"], saved["result"]["candidates"]
        except (OSError, ValueError, KeyError, TypeError):
            return {}
        if any(old.get(k) != fingerprint[k] for k in ("target", "preset", "dtype", "device", "calls", "workloads")):
            return {}
        keys = saved.get("code_keys", {})

        def unchanged(name: str) -> bool:
            return old.get("sources", {}).get(name) == fingerprint["sources"].get(name) or (
                name in keys and name in fingerprint["sources"] and code_key_matches(keys[name], point, name))

        return {c["variant"]: f"{c['skipped'].split(';')[0]}; its code is unchanged since, so it is not tried "
                              f"again (delete {self._cache_file(point)} to try)"
                for c in candidates if STALLED in (c.get("skipped") or "") and unchanged(c["variant"])}

    def _write_inflight(self, point: str, fingerprint: dict, candidates: list[dict]) -> None:
        path = self._inflight_file(point)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump({"fingerprint": fingerprint, "candidates": candidates}, f, indent=1)
        os.replace(path + ".tmp", path)  # never a half-written file, whenever the process dies

    def _watched(self, v, config, workloads, ref_us, fingerprint, unfinished) -> CandidateResult:
        """_try, with the candidate recorded as in flight meanwhile (beside the `unfinished` ones of
        earlier processes) and a watchdog on its time."""
        candidate = {"point": v.point, "variant": v.name, "config": config, "timeout_s": self.candidate_timeout}
        self._write_inflight(v.point, fingerprint, unfinished + [candidate])
        dog = Watchdog(self.candidate_timeout, self.on_stall, candidate).start() if self.candidate_timeout else None
        started = time.perf_counter()
        try:
            result = self._try(v, config, workloads, ref_us)
            result.seconds = time.perf_counter() - started
        except KeyboardInterrupt:  # stopped from outside: recorded as such, and tried again (STOPS_TRIED)
            stops = max((c.get("stopped", 0) for c in unfinished if c["variant"] == v.name), default=0)
            self._write_inflight(v.point, fingerprint, [c for c in unfinished if c["variant"] != v.name]
                                 + [{**candidate, "stopped": stops + 1}])
            raise
        finally:
            compile_s = dog.stop() if dog is not None else 0.0
        result.compile_s = round(compile_s, 1) or None
        self._write_inflight(v.point, fingerprint, unfinished)  # only once it returned: a dying process leaves it
        return result

    def _try(self, v, config, workloads, ref_us) -> CandidateResult:
        r = CandidateResult(v.point, v.name, v.backend, config, False)
        report = gates.op_gate(v, list(workloads.values()), device=self.device, seeds=self.seeds, config=config)
        r.gate, r.gate_passed = report.to_dict(), report.passed
        if not report.passed:
            r.failed_check = report.first_failure()
            return r
        t = self._step_time(v, config, workloads)
        if t["recompiles"]:  # the samples timed compilation too: no valid time, so never chosen
            r.skipped = f"torch.compile made {t['recompiles']} new graphs while it was timed (recompiles)"
            return r
        r.step_us, r.spread, r.speedup = t["step_us"], t["spread"], ref_us / t["step_us"]
        return r

    def _load(self, point: str) -> PointResult | None:
        path = self._cache_file(point)
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            saved = json.load(f)
        if saved.get("fingerprint") != self._fingerprint(point):
            return None  # a variant's source, the target or the machine changed: search again
        result = PointResult.from_dict(saved["result"])
        # A band past MAX_BAND comes from the two-timing rule before _reference_time: it may have hidden
        # a winner, so that point is searched again
        if result.band > MAX_BAND:
            return None
        # A library installed since (FlashInfer, CuTe DSL): its variants were never tried
        installed = [b for b in saved.get("backends_missing", []) if backend_available(b)[0]]
        return None if installed else result

    def _save(self, point: str, result: PointResult) -> None:
        path = self._cache_file(point)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"fingerprint": self._fingerprint(point), "result": result.to_dict(),
                       "backends_missing": _backends_missing(point), "gate_version": gates.GATE_VERSION,
                       "code_keys": {name: code_key(point, name) for name in variants(point)}}, f, indent=1)

    def _drop_model_gate_failures(self, chosen: dict, configs: dict, recorded: _Recorded | None = None):
        """The op gate saw the target's shapes only; the model gate runs a ragged prefill and decode.
        If the chosen set fails it, each choice is gated alone and those that fail are dropped.
        Returns the passing report of the set as given, or None when choices were gated alone."""
        recorded = recorded or _Recorded(self, {}, lambda: None)
        report = recorded.gate(chosen, configs)
        if report.passed:
            return report
        for point in list(chosen):
            alone = recorded.gate({point: chosen[point]}, {point: configs.get(point)})
            if not alone.passed:
                self.on_event({"type": "model_gate_dropped", "point": point, "variant": chosen.pop(point),
                               "why": alone.first_failure()})
                configs.pop(point, None)
        return None

    # ---- end to end --------------------------------------------------------------------
    def time_build(self, selection: dict[str, str], configs: dict[str, dict] | None = None, *,
                   compile_mode: str | None = None, budget_s: float = STEP_SAMPLES_S, **timing_kw) -> dict:
        """The step with `selection` bound, timed by `bench.time_fn` (`timing_kw` go to it)."""
        self.runner.rebind(selection, configs, compile_mode=compile_mode)
        return {**bench.time_fn(self.runner, device=self.device, budget_s=budget_s, **timing_kw),
                "process": bench.PROCESS_ID}

    def time_paired(self, a: tuple[dict, dict], b: tuple[dict, dict]) -> dict:
        """Builds a and b, each (selection, configs), timed in PAIRED_ROUNDS alternating rounds (a b, b a,
        ...): how much slower b is than a (`gain`, the median of the rounds' b / a - 1) and its noise
        band (`paired_gain`). At prefill-8x2k two builds timed minutes apart differed by ~1%, inside a
        1.8% band, what four small choices save together (session 25,
        runs/optimize-prefill-8x2k-beam-501b-tp8/README.md); paired, the same sets differed by 2.19%
        against a 0.5% band (session 26, that folder's end_to_end.json)."""
        rounds = []
        for i in range(PAIRED_ROUNDS):
            first, second = (a, b) if i % 2 == 0 else (b, a)
            # the round's budget also bounds the reps time_call adds while the spread is wide (2 s)
            t1, t2 = (self.time_build(*build, budget_s=PAIRED_ROUND_S, max_seconds=PAIRED_ROUND_S)["median_us"]
                      for build in (first, second))
            rounds.append([t1, t2] if i % 2 == 0 else [t2, t1])
        return {**paired_gain(rounds), "process": bench.PROCESS_ID}

    def finalize(self, results: dict[str, PointResult], journal: dict | None = None,
                 save: Callable[[], None] = lambda: None) -> dict:
        """Time the chosen set end to end, gate it, try candidates tied with a choice at the op level
        end to end, and drop choices that do not help the step.
        Each build's timing and gate goes into `journal` as it is made (then `save()`): at prefill-8x2k
        the stage outlasts one device command, and a resumed run reads them back instead of redoing them."""
        recorded = _Recorded(self, {} if journal is None else journal, save)
        chosen = {p: r.choice for p, r in results.items() if r.choice != REFERENCE}
        configs = {p: r.config for p, r in results.items() if r.config and p in chosen}
        gated = dict(chosen)
        gate = self._drop_model_gate_failures(chosen, configs, recorded)
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
            self.on_event({"type": "challenger", "point": point, **challenge})
            if challenge["won"]:
                chosen, configs = trial, trial_configs
        if any(c["won"] for c in challenges.values()):
            locked = recorded.timing(chosen, configs) if chosen else reference
        band = step_band(locked)
        reverted, reverted_process = {}, {}
        for point in chosen:  # each choice reverted alone, against the whole chosen set
            trial = {p: v for p, v in chosen.items() if p != point}
            timing = recorded.timing(trial, _of(configs, trial))
            reverted[point], reverted_process[point] = timing["median_us"], timing.get("process")
            self.on_event({"type": "revert", "point": point, "reverted_us": reverted[point],
                           "locked_us": locked["median_us"]})
        # Choices whose reversal is within the step's noise may not help: they go, all together, unless a
        # paired timing shows the set with them faster than without beyond its band. Dropped one by one
        # against the shrinking set, each drop's noise added up (prefill-8x2k, session 10: four drops,
        # 289.0 -> 299.0 ms); judged by two builds timed apart, ~1% that they saved together was noise
        # (session 25: 234.627 ms with them, 236.905 without, against a 1.8% band).
        idle = [p for p in chosen if reverted[p] <= locked["median_us"] * (1 + band)]
        dropped, before_drop, paired = {}, None, None
        if idle:
            kept = {p: v for p, v in chosen.items() if p not in idle}
            paired = {"choices": {p: chosen[p] for p in idle},
                      **recorded.paired((chosen, configs), (kept, _of(configs, kept)))}
            paired["kept"] = paired["gain"] > paired["band"]
            self.on_event({"type": "paired", **paired})
            if not paired["kept"]:
                without = recorded.timing(kept, _of(configs, kept)) if kept else reference
                dropped, before_drop = paired["choices"], locked
                self.on_event({"type": "dropped_as_noise", "choices": dropped, "band": band,
                               "before_us": locked["median_us"], "after_us": without["median_us"]})
                chosen, configs, locked = kept, _of(configs, kept), without
        if gate is None or chosen != gated or configs != gated_configs:  # the set changed since it passed
            gate = recorded.gate(chosen, configs)
        if not gate.passed:
            raise RuntimeError(f"the chosen build fails the model gate: {gate.first_failure()}")
        self.runner.rebind(chosen, configs)
        return {"selection": chosen, "configs": configs, "reference": reference, "locked": locked,
                "reverted_us": reverted, "reverted_process": reverted_process, "model_gate": gate.to_dict(),
                "band": band, "dropped": dropped, "before_drop": before_drop, "paired": paired,
                "challenges": challenges}


def _challenger(r: PointResult, step_us: float) -> CandidateResult | None:
    """The point's fastest gated candidate, when it is not the choice and timed faster than it by at
    least CHALLENGE_SHARE of the step (the incumbent kept it out as within the op band)."""
    timed = [c for c in r.candidates if c.gate_passed and c.step_us is not None and not c.skipped]
    best = min(timed, key=lambda c: c.step_us, default=None)
    if best is None or (best.variant, best.config or None) == (r.choice, r.config or None):
        return None
    return best if r.choice_us - best.step_us >= CHALLENGE_SHARE * step_us else None


def _timing(saved) -> dict:
    """A journaled build timing, or KeyError / TypeError when it is not one."""
    float(saved["median_us"]), float(saved["spread"]), int(saved["reps"])
    return dict(saved)


def _paired(saved) -> dict:
    """A journaled paired timing (its gain and band made again from its rounds), or an error."""
    if len(saved["rounds"]) != PAIRED_ROUNDS:
        raise ValueError("a paired timing cut short")
    return {**paired_gain([[float(a), float(b)] for a, b in saved["rounds"]]), "process": saved.get("process")}


def _of(configs: dict, selection: dict) -> dict:
    return {p: c for p, c in configs.items() if p in selection}


class _Recorded:
    """The end-to-end stage's builds (timings and model gates), each made once per journal: a build
    found in it, keyed by its selection and configs, is read back, any other is made and recorded."""

    def __init__(self, search: Search, journal: dict, save: Callable[[], None]):
        self.search, self.journal, self.save = search, journal, save

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
        return self._get("timing", [(selection, configs)], lambda: self.search.time_build(selection, configs),
                         dict, _timing)

    def paired(self, a: tuple[dict, dict], b: tuple[dict, dict]) -> dict:
        return self._get("paired", [a, b], lambda: self.search.time_paired(a, b), dict, _paired)

    def gate(self, selection: dict, configs: dict):
        return self._get("model_gate", [(selection, configs)],
                         lambda: gates.model_gate(self.search.model, selection, configs=configs),
                         lambda report: report.to_dict(), gates.GateReport.from_dict)


def _config_unsupported(v, config, workloads) -> str | None:
    return next((r for r in (v.unsupported_config(config, w) for w in workloads.values()) if r), None)


def _backends_missing(point: str) -> list[str]:
    """Backends of this point's variants that cannot run here (library not installed, no GPU)."""
    return sorted({v.backend for v in variants(point).values() if not backend_available(v.backend)[0]})


def bounded_band(measured: float, least: float = MIN_BAND) -> float:
    """A noise band from a measured relative spread or gap, within [least, MAX_BAND]."""
    return min(max(least, measured), MAX_BAND)


def step_band(timing: dict) -> float:
    """The band within which a whole step's median is noise: three standard errors of the difference
    of two medians of `reps` timings with this spread ((p90 - p10) / median, 2.56 sigma for a normal
    spread; a median's standard error is 1.25 sigma / sqrt(reps)), within [MIN_STEP_BAND, MAX_BAND].
    Twenty reps of a 300 ms prefill step with a 3% spread give 1.4% (six gave 2.5%); a decode step's 50
    reps with a 0.25% spread give the minimum."""
    sigma = timing["spread"] / 2.56
    return bounded_band(3 * 1.25 * sigma * (2 / timing["reps"]) ** 0.5, MIN_STEP_BAND)


def paired_gain(rounds: list[list[float]]) -> dict:
    """From rounds of [a_us, b_us]: `gain`, the median of b / a - 1 (how much slower b is), and `band`,
    three standard errors of that median (1.25 sd / sqrt(rounds)) within [MIN_STEP_BAND, MAX_BAND]."""
    ratios = [b / a for a, b in rounds]
    sd = statistics.stdev(ratios) if len(ratios) > 1 else float("inf")
    return {"rounds": rounds, "gain": statistics.median(ratios) - 1,
            "band": bounded_band(3 * 1.25 * sd / len(ratios) ** 0.5, MIN_STEP_BAND)}


def slower_by(gain: float) -> str:
    """A paired timing's gain in words: "0.42% slower", or "0.43% faster" when it is negative."""
    return f"{100 * abs(gain):.2f}% {'slower' if gain >= 0 else 'faster'}"


def paired_words(paired: dict) -> str:
    """A paired timing in words: "0.42% slower in 10 paired rounds (band 0.50%)"."""
    return f"{slower_by(paired['gain'])} in {len(paired['rounds'])} paired rounds (band {100 * paired['band']:.2f}%)"


def regated_words(e: dict) -> str:
    """A `regated` event in words: a cached choice or gate failure gated again, and what follows."""
    if e.get("was_failed"):
        return (f"cached gate failure {e['variant']} gated again under the current gates: "
                f"{'passes: searching the point again' if e['passed'] else 'fails again'}")
    return (f"cached choice {e['variant']} gated again under the current gates: "
            f"{'passes' if e['passed'] else 'fails: searching the point again'}")


def _gap(a: float, b: float) -> float:
    return abs(a - b) / min(a, b)


def _stuck(unfinished: list[dict], name: str) -> dict | None:
    """The record of an earlier run's unfinished candidate that makes variant `name` skipped, or None:
    records left by runs stopped from outside fewer than STOPS_TRIED times skip nothing."""
    def retried(c):
        return 0 < c.get("stopped", 0) < STOPS_TRIED
    return next((c for c in unfinished if c["variant"] == name and not retried(c)), None)


def _end_process(candidate: dict) -> None:
    builds = f", not counting {candidate['compile_s']:.0f} s of compilers it ran" if candidate.get("compile_s") else ""
    print(f"\nworkbench: {candidate['point']}:{candidate['variant']} {candidate['config'] or ''} ran past "
          f"{candidate['timeout_s']:.0f} s (gate + timing{builds}); ending the process. The same command resumes the "
          f"search and skips this variant (recorded in search/{candidate['point']}.inflight).",
          file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)  # where it was stuck (the main thread's frames)
    os._exit(EXIT_STALLED)  # the stuck thread (a kernel, a compiler) cannot be interrupted from here
