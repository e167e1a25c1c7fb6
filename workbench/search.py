"""The per-point search: gate and time every candidate variant of a fusion point, keep what really helps.

Per point, every available variant that is not quarantined on this device (workbench/quarantine.py)
and each of its tuning configs passes the op gate first, then is timed at the shapes the target calls
it with, weighted by how often one step calls it; it replaces the incumbent only if faster beyond the
noise band (from repeated timings of the reference, `_reference_time`). A candidate timed with a
spread past NOISY_SPREAD measured something besides it: it is timed again once the point's other
candidates are done, and the quieter timing stands.

Each point's result is kept in the run folder (`search/<point>.json`), keyed by what it depends on
(`fingerprint`: the variants' source hashes, the target, the machine, what was left out), so a
stopped run resumes where it was. A point is searched again once a backend library that was missing
then is installed; a result kept under older gates has its choice and its gate failures gated again
before it is reused. A candidate that hangs or kills the process costs one run (`workbench.inflight`).

What it must never do: write the lock or the report (`workbench.optimize` does), time the whole step
(`workbench.end_to_end` does), or edit a variant.
"""

from __future__ import annotations

import copy
import functools
import threading
import time
import types
from dataclasses import replace
from typing import Callable

from workbench import bench, gates
from workbench.dtypes import name_of
from workbench.events import CandidateRetimed, CandidateTried, PointCached, PointDone, PointStarted, Regated
from workbench.inflight import STALLED, InFlight, end_process, stalled_before
from workbench.lock import code_key, source_hash
from workbench.noise import MAX_BAND, bounded_band, relative_difference
from workbench.points import LAYER_DEPENDENT
from workbench.quarantine import quarantined
from workbench.rank_gate import all_reduces, rank_gate, registered
from workbench.registry import COMPOUNDS, REFERENCE, Variant, backend_available, relaid_members, split_of, variants
from workbench.run_folder import RunFolder, read_json, resume_key, write_json
from workbench.search_results import CandidateResult, PointResult

ALL_LAYERS = "all"  # the kind standing for every layer kind of a point whose inputs ignore it
REFERENCE_TIMINGS = 4  # at most, while no two of them agree within MAX_BAND
NOISY_SPREAD = MAX_BAND  # a candidate timed with a wider spread is timed again


class Search:
    def __init__(self, runner, *, calls: dict[str, dict[str, int]], out_dir: str, seeds=(0, 1),
                 on_event: Callable[[object], None] | None = None,
                 backends: tuple[str, ...] | None = None, candidate_timeout: float | None = None,
                 on_stall: Callable[[dict], None] | None = None, ranks: int = 1):
        """`runner`: the target's step (`targets.StepRunner`); `calls[point][kind]`: how often one step
        calls the point in "sliding"/"full" layers; `backends`: try only candidates of these backends
        (None: all); `candidate_timeout`: seconds one candidate's gate + timing may take before
        `on_stall(candidate)` (default: say so and end the process, `inflight.end_process`); `ranks`:
        the tensor-parallel ranks the lock is for: past one, a candidate of a point that all-reduces passes
        the rank gate on that many processes too (`workbench.rank_gate`)."""
        self.runner, self.calls, self.seeds, self.ranks = runner, calls, seeds, ranks
        self.folder = RunFolder(out_dir)
        self.backends = tuple(sorted(backends)) if backends else None
        self.model = runner.model
        self.device = self.model.device
        self.dtype = name_of(self.model.dtype)
        self.on_event = on_event or (lambda e: None)
        self.skip = set()             # points the user asked to skip (TUI)
        self.resume = threading.Event()
        self.resume.set()             # cleared = paused between candidates
        self.candidate_timeout = candidate_timeout
        self.on_stall = on_stall or end_process
        self.choices: dict[str, tuple[str, dict | None]] = {}  # point -> (variant, config) chosen so far

    def step_calls(self, point: str) -> dict[str, int]:
        """Calls per step by the kinds `workloads` returns: a point whose inputs do not depend on the
        layer kind is gated and timed once for all its calls (same shapes, same values), not per kind."""
        calls = self.calls[point]
        return dict(calls) if point in LAYER_DEPENDENT or len(calls) < 2 else {ALL_LAYERS: sum(calls.values())}

    def workloads(self, point: str) -> dict[str, object]:
        preset = self.model.config.preset
        return {kind: self.runner.target.workload(preset, self.dtype, "sliding" if kind == ALL_LAYERS else kind,
                                                  self.model.weights)
                for kind in self.step_calls(point)}

    def cached(self, point: str) -> bool:
        """Whether this point's result is in the run folder and still valid (resuming costs nothing)."""
        return self._load(point) is not None

    # ---- one point ---------------------------------------------------------------------------
    def search_point(self, point: str) -> PointResult:
        cached = self._load(point)
        if cached and self._gated_again(point, cached):
            self.choices[point] = (cached.choice, cached.config)
            self.on_event(PointCached(point, copy.deepcopy(cached)))
            return cached
        self.on_event(PointStarted(point))
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
        fingerprint = self.fingerprint(point)
        inflight = InFlight(self.folder.inflight(point), fingerprint)  # what earlier processes never finished
        stalled = stalled_before(read_json(self.folder.search_result(point)), fingerprint, point,
                                 self.folder.search_result(point))
        for name, v in table.items():
            if name == REFERENCE:
                continue
            why = self._unavailable(v, workloads) or self._relaid_members(point)
            for config in ([None] if why else v.tuning_configs()):  # an unavailable variant: one row
                self.resume.wait()  # paused: a skip asked meanwhile applies before the next candidate
                if point in self.skip:
                    break
                stuck = None if why else inflight.stuck(name)
                skipped = why or _config_unsupported(v, config, workloads) or stalled.get(name) or (
                    stuck is not None and (
                        f"{name} {stuck['config'] or ''} {STALLED} (the process "
                        f"hung, crashed or was stopped in it), so none of its configs is tried; delete "
                        f"{inflight.path} to try again"))
                result = CandidateResult(point, name, v.backend, config, False, skipped=skipped) if skipped else \
                    self._watched(v, config, workloads, ref_us, inflight)
                results.append(result)
                self.on_event(CandidateTried(point, copy.deepcopy(result)))
        if point not in self.skip:
            self._retime_noisy(table, results[1:], workloads, ref_us)
        for result in results[1:]:  # in order: a candidate replaces the best so far beyond the band only
            if result.step_us is not None and result.step_us < best.step_us * (1 - band):
                best = result
        out = PointResult(point, best.variant, best.config, ref_us, best.step_us, band, results)
        self.choices[point] = (out.choice, out.config)
        if point not in self.skip:  # a skipped point was not searched: a resumed run searches it
            self._save(point, out)
            inflight.clear()
        self.on_event(PointDone(point, copy.deepcopy(out)))
        return out

    def _watched(self, v, config, workloads, ref_us, inflight: InFlight) -> CandidateResult:
        """_try, with the candidate recorded as in flight meanwhile and a watchdog on its time."""
        candidate = {"point": v.point, "variant": v.name, "config": config, "timeout_s": self.candidate_timeout}

        def attempt() -> CandidateResult:
            started = time.perf_counter()
            result = self._try(v, config, workloads, ref_us)
            result.seconds = time.perf_counter() - started
            return result

        result, compile_s = inflight.watched(candidate, attempt, timeout_s=self.candidate_timeout,
                                             on_stall=self.on_stall)
        result.compile_s = round(compile_s, 1) or None
        return result

    def _try(self, v, config, workloads, ref_us) -> CandidateResult:
        r = CandidateResult(v.point, v.name, v.backend, config, False)
        report = gates.op_gate(v, list(workloads.values()), device=self.device, seeds=self.seeds, config=config)
        if report.passed and self.ranks > 1 and all_reduces(v.point):  # one process never all-reduces
            ranked = rank_gate(registered(v.point, v.name), list(workloads.values()), world=self.ranks,
                               device=self.device, seeds=self.seeds, config=config)
            report.checks += ranked.checks
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

    def _step_time(self, variant, config, workloads) -> dict:
        """Median time one step spends in this point with this candidate, and the spread."""
        total, spread, recompiles = 0.0, 0.0, 0
        calls = self.step_calls(variant.point)
        for kind, workload in workloads.items():
            t = bench.time_variant(variant, workload, device=self.device, config=config)
            total += calls[kind] * t["median_us"]
            spread, recompiles = max(spread, t["spread"]), recompiles + t["recompiles"]
        return {"step_us": total, "spread": spread, "recompiles": recompiles}

    def _reference_time(self, ref, workloads) -> tuple[float, float, float]:
        """The reference's step time, the noise band and its spread. The reference is timed until two
        timings agree within MAX_BAND (REFERENCE_TIMINGS at most); the closest two give the time (the
        faster) and the band (their gap, within [MIN_BAND, MAX_BAND]). One timing slowed by something
        besides the op (allocator growth, clocks) would otherwise set the band, and a band that wide
        keeps out a kernel many times faster."""
        timings = [self._step_time(ref, None, workloads) for _ in range(2)]
        while True:
            gap, pair = min(((relative_difference(a["step_us"], b["step_us"]), (a, b))
                             for i, a in enumerate(timings) for b in timings[i + 1:]), key=lambda g: g[0])
            if gap <= MAX_BAND or len(timings) >= REFERENCE_TIMINGS:
                break
            timings.append(self._step_time(ref, None, workloads))
        fast = min(pair, key=lambda t: t["step_us"])
        return fast["step_us"], bounded_band(gap), fast["spread"]

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
                self.on_event(CandidateRetimed(r.point, copy.deepcopy(r)))

    # ---- which candidates are tried ----------------------------------------------------------
    def _left_out(self, v) -> str | None:
        """Why the search does not try a variant that may well run here: --backends, or quarantine."""
        if self.backends and v.backend not in self.backends:
            return f"backend {v.backend!r} left out (--backends {' '.join(self.backends)})"
        return quarantined(v.point, v.name, self.device)

    def _unavailable(self, v, workloads) -> str | None:
        """Why a variant is not tried at these shapes, or None."""
        return self._left_out(v) or next((r for r in (v.unsupported(w, self.device) for w in workloads.values())
                                          if r), None)

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

    # ---- the point's result in the run folder ------------------------------------------------
    def fingerprint(self, point: str) -> dict:
        """What a cached result depends on, as it reads back from JSON."""
        table = variants(point)
        # What was not tried (--backends, quarantine) keys the result, whatever the reason: a point that
        # leaves nothing out reuses an unfiltered run's result, and a lifted quarantine searches again.
        left_out = sorted(name for name, v in table.items() if name != REFERENCE and self._left_out(v))
        return resume_key({
            "target": self.runner.target.name, "preset": self.model.config.preset, "dtype": self.dtype,
            "device": str(self.device.type), "calls": self.calls[point],
            "workloads": {kind: w.label() for kind, w in self.workloads(point).items()},
            "sources": {name: source_hash(point, name) for name in table},
            **({"members": self._member_choices(point)} if point in COMPOUNDS else {}),
            **({"ranks": self.ranks} if self.ranks > 1 and all_reduces(point) else {}),
            **({"left_out": left_out} if left_out else {})})

    def _load(self, point: str) -> PointResult | None:
        saved = read_json(self.folder.search_result(point))
        if saved is None:
            return None
        if saved.get("fingerprint") != self.fingerprint(point):
            return None  # a variant's source, the target or the machine changed: search again
        result = PointResult.from_dict(saved["result"])
        # A band past MAX_BAND comes from a rule that timed the reference twice only: it may have hidden
        # a winner, so that point is searched again
        if result.band > MAX_BAND:
            return None
        # A library installed since (FlashInfer, CuTe DSL): its variants were never tried
        installed = [b for b in saved.get("backends_missing", []) if backend_available(b)[0]]
        return None if installed else result

    def _save(self, point: str, result: PointResult) -> None:
        write_json(self.folder.search_result(point), {
            "fingerprint": self.fingerprint(point), "result": result.to_dict(),
            "backends_missing": _backends_missing(point), "gate_version": gates.GATE_VERSION,
            "code_keys": {name: code_key(point, name) for name in variants(point)}}, indent=1)

    def _gated_again(self, point: str, result: PointResult) -> bool:
        """Whether a cached result may be reused under the current gates. One cached under an older
        GATE_VERSION has the candidates those gates failed gated again first: one that passes now (a
        check was relaxed) was never timed, so the point is searched again. Then its choice: if it
        fails now (a check was added), the point is searched again. The verdicts of the other
        candidates that passed stay as recorded: only the choice is locked."""
        if (read_json(self.folder.search_result(point)) or {}).get("gate_version") == gates.GATE_VERSION:
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
        self.on_event(Regated(point, v.name, config, was_failed, report.passed))
        return report


def _config_unsupported(v, config, workloads) -> str | None:
    return next((r for r in (v.unsupported_config(config, w) for w in workloads.values()) if r), None)


def _backends_missing(point: str) -> list[str]:
    """Backends of this point's variants that cannot run here (library not installed, no GPU)."""
    return sorted({v.backend for v in variants(point).values() if not backend_available(v.backend)[0]})
