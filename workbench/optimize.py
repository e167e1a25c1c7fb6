"""`workbench optimize`: profile a target, search the variants under the gates, lock, report.

The product's main job, as a library call the CLI and the TUI share. Its stages, each resumable from
the run folder (`workbench.run_folder`): the reference step's profile; the whole-step torch.compile
baselines; the per-point search (`workbench.search`), points ranked by what they could save; agent
rounds (optional); the end-to-end stage (`workbench.end_to_end`); the locked step's profile; each
point's cost in the running step (optional); then `lock.yaml`, `report.json` and `report.md` with the
command that made them. Speed-ups are ratios of timings taken on this one device.

What it must never do: write anything before its refusals are checked (`workbench.preflight`),
report a figure it did not measure, or decide a rule the search or the end-to-end stage owns.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import torch

from beam_model import BeamForCausalLM
from workbench import compile_baseline, timing
from workbench.dtypes import name_of
from workbench.end_to_end import FINALIZE_RULE, STEP_SAMPLES_S, EndToEnd
from workbench.events import Done, EndToEndResumed, InStepLine, Profiled, StageStarted, Stopped
from workbench.lock import Lock, module_key, reference_key
from workbench.preflight import check_backends, check_relock
from workbench.profiler import profile_step
from workbench.profiler.attribution import Profile
from workbench.profiler.in_step import in_step_costs
from workbench.provenance import environment
from workbench.registry import COMPOUNDS, POINTS, REFERENCE, get
from workbench.report import (
    against_previous,
    backend_bests,
    locked_point_us,
    mark_run_by_compounds,
    timed_apart,
    write_report,
)
from workbench.roofline import measure_device_ceilings
from workbench.run_folder import RunFolder, resume_key
from workbench.search import Search
from workbench.targets import StepRunner, for_device, get_target
from workbench.tp_step import time_tp_builds


@dataclass
class OptimizeOptions:
    target: str = "decode-b1"
    preset: str = "beam-tiny"
    dtype: torch.dtype = torch.float32
    weights: str = "bf16"  # the projections' stored format (`BeamForCausalLM.from_preset(weights=...)`)
    device: torch.device = torch.device("cpu")
    out_dir: str = "runs/optimize-decode-b1"
    seed: int = 0
    seeds: tuple[int, ...] = (0, 1)
    points: tuple[str, ...] = POINTS
    trust: bool = False
    budget_s: float | None = None  # stop before a new point's search once spent; the run resumes
    backends: tuple[str, ...] | None = None  # search only these backends' candidates (None: all)
    candidate_timeout: float | None = 900.0  # end the run when one candidate takes longer (resume skips it)
    force: bool = False  # write over the run folder's lock even where this run cannot search all its choices
    command: str = ""
    agent: object | None = None    # workbench.agent.loop.AgentOptions: agent rounds after the search
    # The torch.compile baselines, each a row of the report: "points" (each point's torch_compile variant)
    # or a torch.compile mode for the whole reference step, e.g. "max-autotune-no-cudagraphs" (the step is
    # graph-captured anyway). The first fills the report's torch_compile_* fields.
    compile_baselines: tuple[str, ...] = ("points",)
    # Tensor-parallel ranks the lock is for (`--tp`): past one, a point that all-reduces passes the rank gate
    # on that many processes, and the reference and locked steps are timed on that many ranks at once.
    tp: int = 1
    step_samples_s: float = STEP_SAMPLES_S  # seconds of samples per build timing in the end-to-end stage
    # After the lock: each point's cost in the locked step as it runs (`workbench.profiler.in_step`), a
    # report column: the step's time less its time with the point replaced by a kernel-free stand-in.
    # Seconds of samples per step timing; None: not timed.
    in_step_s: float | None = None


# The code every timed step runs whatever the variants: the model and the target's step runner.
STEP_MODULES = ("beam_model/model.py", "workbench/targets.py")


def profile_key(opts: OptimizeOptions, dtype: str, workload_for) -> dict:
    """What the reference profile depends on: the step, the shapes its floors are computed at, the
    machine, the model and step runner's code, the reference variants' code."""
    return resume_key({
        "target": opts.target, "preset": opts.preset, "dtype": dtype, "seed": opts.seed,
        "workloads": {kind: workload_for(kind).label() for kind in ("sliding", "full", "model")},
        "device": str(opts.device),
        "gpu": torch.cuda.get_device_name(opts.device) if opts.device.type == "cuda" else None,
        "step": module_key(*STEP_MODULES), "reference": {p: reference_key(p) for p in POINTS}})


def rank_points(profile) -> list[str]:
    """Points by what they could save: time above the floor (the whole time when no floor is known)."""
    def saving(p):
        return p.time_us - (p.floor_us or 0.0)
    ranked = [p.point for p in sorted(profile.points, key=saving, reverse=True)]
    # a compound last: the build it is judged in end to end runs its members' choices without it
    return [p for p in ranked if p not in COMPOUNDS] + [p for p in ranked if p in COMPOUNDS]


def resumed_first(order: list[str], search) -> list[str]:
    """Points the run folder already holds settle first (they cost nothing), so a resumed run shows them
    at once and a pause or a budget stops only work still to do. A compound keeps its place after its
    members: whether it is cached depends on their choices."""
    parts = [p for p in order if p not in COMPOUNDS]
    cached = [p for p in parts if search.cached(p)]
    return cached + [p for p in parts if p not in cached] + [p for p in order if p in COMPOUNDS]


def optimize(opts: OptimizeOptions, on_event=None) -> dict:
    with contextlib.ExitStack() as cleanup:  # the sandboxes agent rounds leave, ended however the run ends
        return _optimize(opts, on_event, cleanup)


def _optimize(opts: OptimizeOptions, on_event, cleanup: contextlib.ExitStack) -> dict:
    if opts.tp < 1:
        raise ValueError(f"--tp must be at least 1, got {opts.tp}")
    if not opts.step_samples_s > 0:
        raise ValueError(f"--step-seconds must be above 0, got {opts.step_samples_s}")
    if opts.tp > 1 and opts.agent is not None:
        raise ValueError("--agent runs on one process: agent rounds and --tp above 1 do not combine")
    check_backends(opts.backends)  # these two before anything is written to the run folder
    check_relock(opts.out_dir, device=opts.device, backends=opts.backends, points=opts.points, force=opts.force)
    on_event = on_event or (lambda e: None)
    started = time.monotonic()
    folder = RunFolder(opts.out_dir)
    os.makedirs(folder.root, exist_ok=True)
    dtype = name_of(opts.dtype)
    on_event(StageStarted("build", preset=opts.preset))
    model = BeamForCausalLM.from_preset(opts.preset, seed=opts.seed, dtype=opts.dtype, device=opts.device,
                                        weights=opts.weights)
    target = for_device(get_target(opts.target), opts.device)
    runner = StepRunner(model, target)
    ceilings = measure_device_ceilings(opts.device)

    def workload_for(kind):
        return target.workload(opts.preset, dtype, kind, opts.weights)

    on_event(StageStarted("profile"))
    key = profile_key(opts, dtype, workload_for)
    profile = folder.saved(folder.PROFILE, key, Profile.from_dict)  # a resumed run: the reference step is the same
    if profile is None:
        profile = profile_step(runner, workload_for=workload_for, ceilings=ceilings,
                               trace_path=folder.path(folder.PROFILE_TRACE))
        folder.write(folder.PROFILE, {**profile.to_dict(), "key": key})
    on_event(Profiled(profile))

    calls = {p.point: p.calls_by_kind for p in profile.points}
    search = Search(runner, calls=calls, out_dir=opts.out_dir, seeds=opts.seeds, on_event=on_event,
                    backends=opts.backends, candidate_timeout=opts.candidate_timeout, ranks=opts.tp)
    stage = EndToEnd(runner, on_event=on_event, step_samples_s=opts.step_samples_s)
    whole = compile_baseline.whole_step_baselines(stage, opts.compile_baselines, key, folder, on_event)
    order = resumed_first([p for p in rank_points(profile) if p in opts.points], search)
    on_event(StageStarted("search", order=order, search=search))
    results = {}
    for p in order:
        if opts.budget_s is not None and time.monotonic() - started > opts.budget_s and not search.cached(p):
            pending = [q for q in order if q not in results]
            on_event(Stopped(pending))
            return {"stopped": True, "pending": pending, "searched": list(results), "out_dir": opts.out_dir}
        results[p] = search.search_point(p)

    if opts.agent is not None and results:
        from workbench.agent.candidates import close_sandboxed
        from workbench.agent.loop import agent_rounds
        from workbench.agent.step_sandbox import for_accepted

        on_event(StageStarted("agent"))
        cleanup.callback(close_sandboxed)
        agent_rounds(search, results, profile, opts.agent, out_dir=opts.out_dir, trust=opts.trust, on_event=on_event)
        # accepted candidates run in sandboxes here: the builds with them are timed in a step sandbox
        stage.timer = for_accepted(runner, preset=opts.preset, seed=opts.seed, dtype=dtype, target=opts.target)
        if stage.timer is not None:
            cleanup.callback(stage.timer.close)

    on_event(StageStarted("end-to-end"))
    e2e_key = resume_key({"profile": key, "rule": FINALIZE_RULE,
                          "points": {p: search.fingerprint(p) for p in results},
                          "choices": {p: [r.choice, r.config] for p, r in results.items()}})
    saved = folder.saved(folder.END_TO_END, e2e_key) or {}  # a run stopped after this stage: minutes at prefill
    final = saved.get("final")
    if final is None:
        journal = saved.get("journal", {})
        if journal:
            on_event(EndToEndResumed(len(journal)))
        final = stage.finalize(results, journal=journal,
                               save=lambda: folder.write(folder.END_TO_END, {"key": e2e_key, "journal": journal}))
        folder.write(folder.END_TO_END, {"key": e2e_key, "final": final})
    else:
        on_event(EndToEndResumed())
    # each baseline is kept as it is timed (every point's compile takes minutes at prefill)
    baselines = folder.saved(folder.END_TO_END, e2e_key, lambda saved: saved.get("compile_baselines", {}))
    for mode in opts.compile_baselines:
        if mode not in baselines:
            baselines[mode] = whole.get(mode) or [*compile_baseline.time_compile_baseline(stage, mode, results),
                                                  timing.PROCESS_ID]
            folder.write(folder.END_TO_END, {"key": e2e_key, "final": final, "compile_baselines": baselines})
    # where the locked step's time goes, point by point and kernel by kernel, as `workbench profile` says
    if stage.timer is not None:
        locked_profile = stage.timer.profile(final["selection"], final["configs"], ceilings=ceilings,
                                             trace_path=folder.path(folder.LOCKED_PROFILE_TRACE))
    else:
        runner.rebind(final["selection"], final["configs"])
        locked_profile = profile_step(runner, workload_for=workload_for, ceilings=ceilings,
                                      trace_path=folder.path(folder.LOCKED_PROFILE_TRACE))
    folder.write(folder.LOCKED_PROFILE, locked_profile.to_dict())
    in_step = None
    if opts.in_step_s is not None:
        on_event(StageStarted("in-step costs"))

        def log(line: str) -> None:
            on_event(InStepLine(line))

        if stage.timer is not None:
            in_step = stage.timer.in_step(final["selection"], final["configs"], budget_s=opts.in_step_s, log=log)
        else:
            in_step = in_step_costs(runner, final["selection"], final["configs"], device=opts.device,
                                    budget_s=opts.in_step_s, log=log)
        folder.write(folder.IN_STEP, in_step)

    across = None
    if opts.tp > 1:
        on_event(StageStarted("across ranks"))
        across = _across_ranks(opts, dtype, final, folder, e2e_key)

    env = environment()
    compiled_us = baselines[opts.compile_baselines[0]][0] if opts.compile_baselines else None
    _write_lock(folder, opts, model, dtype, env, final, results, calls, compiled_us, across)
    report = _report(opts, dtype, env, target, final, {m: baselines[m] for m in opts.compile_baselines}, results,
                     profile, locked_profile, in_step)
    report["across_ranks"] = across
    mark_run_by_compounds(report)
    report["previous"] = against_previous(folder.read(folder.REPORT), report)
    write_report(folder, report)
    on_event(Done(report))
    return report


def _across_ranks(opts: OptimizeOptions, dtype: str, final: dict, folder: RunFolder, e2e_key: dict) -> dict:
    """The reference and the locked builds' steps on `opts.tp` ranks at once, each rank its own slice's
    weights (`tp_step.time_tp_builds`): each build's step is its slowest rank's median, as every rank
    waits for that one at the next all-reduce. Kept in the run folder, keyed, for a resumed run."""
    key = resume_key({"end_to_end": e2e_key, "ranks": opts.tp, "selection": final["selection"],
                      "configs": final["configs"]})
    saved = folder.saved(folder.ACROSS_RANKS, key)
    if saved is not None:
        return {k: v for k, v in saved.items() if k != "key"}
    timed = time_tp_builds(opts.preset, opts.target, opts.tp,
                           {"reference": (None, None), "locked": (final["selection"], final["configs"])},
                           device_type=opts.device.type, dtype=dtype, weights=opts.weights, seed=opts.seed)
    builds = timed["builds"]
    across = {**timed, "speedup": builds["reference"]["step_ms"] / builds["locked"]["step_ms"]}
    folder.write(folder.ACROSS_RANKS, {**across, "key": key})
    return across


def _write_lock(folder: RunFolder, opts: OptimizeOptions, model, dtype: str, env: dict, final: dict,
                results: dict, calls: dict, compiled_us: float | None, across: dict | None) -> None:
    """lock.yaml: each point's locked variant and config with its evidence (the search's timing of it,
    its gate) and how often the reference step calls it (`calls`, the profile's), and the end-to-end
    timings."""
    selection = {p: final["selection"].get(p, REFERENCE) for p in POINTS}
    entries = {}
    for point in POINTS:
        r = results.get(point)
        cand = r.candidate(selection[point], final["configs"].get(point)) if r else None
        timed = {"step_us": locked_point_us(r, selection[point], final["configs"].get(point)),
                 "reference_us": r.reference_us, "noise_band": r.band} if r else {}
        entries[point] = Lock.entry(point, selection[point], config=final["configs"].get(point), timing=timed,
                                    gate=(cand.gate if cand and cand.gate else {"passed": True, "reference": True}),
                                    calls=sum(calls.get(point, {}).values()))
    lock = Lock(model={"preset": opts.preset, "config_hash": model.config.config_hash(), "dtype": dtype,
                       "weights": opts.weights},
                target=opts.target, environment=env, points=entries, command=opts.command,
                created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                end_to_end={"reference_us": final["reference"]["median_us"],
                            "locked_us": final["locked"]["median_us"],
                            "torch_compile_us": compiled_us, "model_gate": final["model_gate"],
                            **({"across_ranks": {"ranks": across["world"], "backend": across["backend"],
                                                 "reference_us": across["builds"]["reference"]["step_ms"] * 1e3,
                                                 "locked_us": across["builds"]["locked"]["step_ms"] * 1e3}}
                               if across else {})})
    lock.save(folder.path(folder.LOCK))


def _report(opts: OptimizeOptions, dtype: str, env: dict, target, final: dict, baselines: dict, results: dict,
            profile, locked_profile, in_step: dict | None) -> dict:
    """report.json's content: the builds' step times and speed-ups, the end-to-end stage's decisions,
    the floor, and per point its locked variant beside the search's and the profiler's figures."""
    locked_us, reference_us = final["locked"]["median_us"], final["reference"]["median_us"]
    first = opts.compile_baselines[0] if opts.compile_baselines else None  # none asked for: no compile row
    compiled_us, not_compiled, compile_error = baselines[first][:3] if first else (None, {}, None)
    # the step's floor from the locked profile: the per-point floors beside it use the same measured ceilings
    floor_us = sum(p.floor_us or 0.0 for p in locked_profile.points)
    in_locked = {pp.point: pp for pp in locked_profile.points}
    selection = {p: final["selection"].get(p, REFERENCE) for p in POINTS}
    return {
        "target": opts.target, "preset": opts.preset, "dtype": dtype, "gpu": env.get("gpu"),
        "command": opts.command, "environment": env,
        "step": {"batch": target.batch, "tokens_per_seq": target.tokens_per_seq, "context": target.context},
        "reference_ms": reference_us / 1e3,
        "locked_ms": locked_us / 1e3,
        "torch_compile_ms": compiled_us / 1e3 if compiled_us else None,
        "torch_compile_baseline": first,
        "torch_compile_left_out": not_compiled,
        **({"torch_compile_error": compile_error} if compile_error else {}),
        "torch_compile_baselines": [
            {"mode": mode, "ms": us / 1e3 if us else None, "speedup": us / locked_us if us else None,
             "left_out": left_out, **({"error": error} if error else {}),
             **({"variants": {p: c.variant for p, c in compile_baseline.plain_choices(results).items()}}
                if mode.startswith(compile_baseline.PLAIN) else {})}
            for mode, (us, left_out, error, *_) in baselines.items()],
        "timed_apart": timed_apart(final, baselines),
        # choices the end-to-end stage dropped as noise, and the chosen set's step time before it did
        "dropped": final.get("dropped") or {},
        "before_drop_ms": final["before_drop"]["median_us"] / 1e3 if final.get("before_drop") else None,
        "step_band": final.get("band"),
        # the paired timing of the set with and without those choices that decided it
        "paired": final.get("paired"),
        # candidates tied with a point's choice at the op level, tried end to end
        "challenges": final.get("challenges") or {},
        "speedup": reference_us / locked_us,
        "speedup_vs_torch_compile": compiled_us / locked_us if compiled_us else None,
        "floor_ms": floor_us / 1e3,
        "fraction_of_floor": floor_us / locked_us if floor_us else None,
        "kernels_per_layer": {"reference": profile.kernels_per_layer, "locked": locked_profile.kernels_per_layer},
        "locked_idle": locked_profile.idle,
        "in_step": {"step_ms": in_step["step_ms"], "rounds": in_step["rounds"]} if in_step else None,
        "points": [
            {"point": p, "variant": selection[p], "config": final["configs"].get(p),
             "backend": get(p, selection[p]).backend,
             "ms": locked_point_us(results[p], selection[p], final["configs"].get(p)) / 1e3 if p in results else None,
             "reference_ms": results[p].reference_us / 1e3 if p in results else None,
             "reverted_ms": final["reverted_us"][p] / 1e3 if p in final["reverted_us"] else None,
             "best_ms_by_backend": backend_bests(results[p]) if p in results else {},
             # the profiler's device time of the point in one locked step (eager), and its bytes/FLOPs floor
             "locked_step_ms": in_locked[p].time_us / 1e3 if p in in_locked else None,
             "floor_ms": in_locked[p].floor_us / 1e3 if p in in_locked and in_locked[p].floor_us else None,
             # the step less the step with the point stood in for (in_step.json)
             "in_step_ms": in_step["costs"][p]["cost_ms"] if in_step and p in in_step["costs"] else None}
            for p in POINTS
        ],
    }
