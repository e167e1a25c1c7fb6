"""`workbench optimize`: profile a target, search the variants under the gates, lock, report.

The product's main job, as a library call the CLI and the TUI share. Everything it claims lands in
the run folder: `profile.json` (+ a Chrome/Perfetto trace), `search/<point>.json` (resumable),
`lock.yaml`, `report.json` and `report.md` with the command that made them. Speed-ups are ratios
of timings taken in this one run on this one device.
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from dataclasses import dataclass

import torch

from beam_model import BeamForCausalLM
from workbench import bench
from workbench.lock import Lock, LockError, module_key, reference_key, run_by
from workbench.profiler import profile_step
from workbench.profiler.attribution import Profile
from workbench.profiler.idle import idle_line
from workbench.profiler.in_step import in_step_costs
from workbench.registry import COMPOUNDS, POINTS, REFERENCE, _compiled, backend_available, get
from workbench.search import FINALIZE_RULE, PointResult, Search, paired_words, slower_by
from workbench.targets import StepRunner, for_device, get_target

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass
class OptimizeOptions:
    target: str = "decode-b1"
    preset: str = "beam-tiny"
    dtype: torch.dtype = torch.float32
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
    # After the lock: each point's cost in the locked step as it runs (`workbench.profiler.in_step`), a
    # report column: the step's time less its time with the point replaced by a kernel-free stand-in.
    # Seconds of samples per step timing; None: not timed.
    in_step_s: float | None = None


# The code every timed step runs whatever the variants: the model and the target's step runner.
STEP_MODULES = ("beam_model/model.py", "workbench/targets.py")


def _profile_key(opts: OptimizeOptions, dtype: str, workload_for) -> dict:
    """What the reference profile depends on: the step, the shapes its floors are computed at, the
    machine, the model and step runner's code, the reference variants' code."""
    return json.loads(json.dumps({
        "target": opts.target, "preset": opts.preset, "dtype": dtype, "seed": opts.seed,
        "workloads": {kind: workload_for(kind).label() for kind in ("sliding", "full", "model")},
        "device": str(opts.device), "gpu": torch.cuda.get_device_name(opts.device) if opts.device.type == "cuda" else None,
        "step": module_key(*STEP_MODULES), "reference": {p: reference_key(p) for p in POINTS}}))


def _saved(path: str, key: dict, read):
    """`read` of a JSON file this run folder keeps beside its results (profile.json, end_to_end.json)
    when it was made for `key`, so a resumed run skips that stage (minutes at prefill-8x2k), else None."""
    saved = _read_json(path)
    try:
        return read(saved) if isinstance(saved, dict) and saved.get("key") == key else None
    except (TypeError, KeyError):
        return None


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def rank_points(profile) -> list[str]:
    """Points by what they could save: time above the floor (the whole time when no floor is known)."""
    def saving(p):
        return p.time_us - (p.floor_us or 0.0)
    ranked = [p.point for p in sorted(profile.points, key=saving, reverse=True)]
    # a compound last: the build it is judged in end to end runs its members' choices without it
    return [p for p in ranked if p not in COMPOUNDS] + [p for p in ranked if p in COMPOUNDS]


def _write_json(path: str, obj) -> None:
    """Written whole or not at all (a run ended mid-write keeps the file it had)."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2, default=str)
        f.write("\n")
    os.replace(path + ".tmp", path)


def check_backends(backends: tuple[str, ...] | None) -> None:
    """Backends named for the search must all be able to run here. One that cannot (an unknown name, a
    library missing, no GPU) would have its variants skipped one by one and its locked choices dropped
    at the end-to-end stage, and a re-lock would write over the lock a build without them (a
    prefill-8x2k re-lock on a host missing half its GPU bundle:
    runs/optimize-prefill-8x2k-beam-501b-tp8/logs/28z-*.log)."""
    missing = [reason for ok, reason in map(backend_available, backends or ()) if not ok]
    if missing:
        raise ValueError("--backends names backends that cannot run here: " + "; ".join(missing)
                         + ". Install them, or leave them out of --backends")


def check_relock(opts: OptimizeOptions) -> None:
    """A run in a folder holding a lock writes over it: refuse (unless forced) when this run cannot
    search one of that lock's choices (its backend missing here, left out of --backends, its point
    not searched, the variant gone). Otherwise the choice drops out and the lock written is a worse
    build, as a decode re-lock on a host without FlashInfer once wrote
    (runs/optimize-decode-b1-beam-501b-tp8/logs/36z-*.log)."""
    path = os.path.join(opts.out_dir, "lock.yaml")
    if opts.force or not os.path.exists(path):
        return
    try:
        lock, _ = Lock.load(path)
    except LockError as e:
        raise ValueError(f"{e}. This run would write over it: move it away, or pass --force") from None
    lost = []
    for point, entry in lock.points.items():
        if point not in POINTS or entry["variant"] == REFERENCE:
            continue
        try:
            v = get(point, entry["variant"])
        except KeyError:
            lost.append(f"{point}:{entry['variant']} (no longer registered)")
            continue
        why = (v.unsupported(device=opts.device)
               or (f"backend {v.backend!r} left out of --backends" if opts.backends and v.backend not in opts.backends
                   else None)
               or (f"{point} is not among --points" if point not in opts.points else None))
        if why:
            lost.append(f"{v.qualname} ({why})")
    if lost:
        raise ValueError(f"{path} locks choices this run cannot search: {'; '.join(lost)}. A re-lock here would "
                         "replace it with a build without them: run where they can run, write to another --out, "
                         "or pass --force")


def optimize(opts: OptimizeOptions, on_event=None) -> dict:
    check_backends(opts.backends)  # these two before anything is written to the run folder
    check_relock(opts)
    on_event = on_event or (lambda e: None)
    started = time.monotonic()
    os.makedirs(opts.out_dir, exist_ok=True)
    dtype = DTYPE_NAMES[opts.dtype]
    on_event({"type": "stage", "stage": "build", "preset": opts.preset})
    model = BeamForCausalLM.from_preset(opts.preset, seed=opts.seed, dtype=opts.dtype, device=opts.device)
    target = for_device(get_target(opts.target), opts.device)
    runner = StepRunner(model, target)
    ceilings = bench.measure_device_ceilings(opts.device)

    def workload_for(kind):
        return target.workload(opts.preset, dtype, kind)

    on_event({"type": "stage", "stage": "profile"})
    key = _profile_key(opts, dtype, workload_for)
    # a resumed run: the reference step is the same
    profile = _saved(os.path.join(opts.out_dir, "profile.json"), key, Profile.from_dict)
    if profile is None:
        profile = profile_step(runner, workload_for=workload_for, ceilings=ceilings,
                               trace_path=os.path.join(opts.out_dir, "profile.trace.json"))
        _write_json(os.path.join(opts.out_dir, "profile.json"), {**profile.to_dict(), "key": key})
    on_event({"type": "profile", "profile": profile})

    calls = {p.point: p.calls_by_kind for p in profile.points}
    search = Search(runner, calls=calls, out_dir=opts.out_dir, seeds=opts.seeds, on_event=on_event, trust=opts.trust,
                    backends=opts.backends, candidate_timeout=opts.candidate_timeout)
    whole = whole_step_baselines(search, opts, key, on_event)
    order = [p for p in rank_points(profile) if p in opts.points]
    # The live Search rides on this event so a UI can skip points and pause (`search.skip`, `search.resume`).
    on_event({"type": "stage", "stage": "search", "order": order, "search": search})
    results = {}
    for p in order:
        if opts.budget_s is not None and time.monotonic() - started > opts.budget_s and not search.cached(p):
            pending = [q for q in order if q not in results]
            on_event({"type": "stopped", "pending": pending})
            return {"stopped": True, "pending": pending, "searched": list(results), "out_dir": opts.out_dir}
        results[p] = search.search_point(p)

    if opts.agent is not None and results:
        from workbench.agent.loop import agent_rounds

        on_event({"type": "stage", "stage": "agent"})
        agent_rounds(search, results, profile, opts.agent, out_dir=opts.out_dir, trust=opts.trust, on_event=on_event)

    on_event({"type": "stage", "stage": "end-to-end"})
    e2e_key = json.loads(json.dumps({"profile": key, "rule": FINALIZE_RULE,
                                     "points": {p: search._fingerprint(p) for p in results},
                                     "choices": {p: [r.choice, r.config] for p, r in results.items()}}))
    # a run stopped after this stage: minutes of timing at prefill
    e2e_path = os.path.join(opts.out_dir, "end_to_end.json")
    saved = _saved(e2e_path, e2e_key, lambda saved: saved) or {}
    final = saved.get("final")
    if final is None:
        journal = saved.get("journal", {})
        if journal:
            on_event({"type": "resumed_end_to_end", "builds": len(journal)})
        final = search.finalize(results, journal=journal,
                                save=lambda: _write_json(e2e_path, {"key": e2e_key, "journal": journal}))
        _write_json(e2e_path, {"key": e2e_key, "final": final})
    else:
        on_event({"type": "resumed_end_to_end"})
    # each baseline is kept as it is timed (every point's compile takes minutes at prefill)
    baselines = _saved(e2e_path, e2e_key, lambda saved: saved.get("compile_baselines", {}))
    for mode in opts.compile_baselines:
        if mode not in baselines:
            baselines[mode] = whole.get(mode) or [*time_compile_baseline(search, mode, results), bench.PROCESS_ID]
            _write_json(e2e_path, {"key": e2e_key, "final": final, "compile_baselines": baselines})
    compiled_us, not_compiled, compile_error = baselines[opts.compile_baselines[0]][:3]
    search.runner.rebind(final["selection"], final["configs"])
    # where the locked step's time goes, point by point and kernel by kernel, as `workbench profile` says
    locked_profile = profile_step(runner, workload_for=workload_for, ceilings=ceilings,
                                  trace_path=os.path.join(opts.out_dir, "locked_profile.trace.json"))
    _write_json(os.path.join(opts.out_dir, "locked_profile.json"), locked_profile.to_dict())
    in_locked = {pp.point: pp for pp in locked_profile.points}
    in_step = None
    if opts.in_step_s is not None:
        on_event({"type": "stage", "stage": "in-step costs"})
        in_step = in_step_costs(runner, final["selection"], final["configs"], device=opts.device,
                                budget_s=opts.in_step_s, log=lambda line: on_event({"type": "in_step", "line": line}))
        _write_json(os.path.join(opts.out_dir, "in_step.json"), in_step)

    # the step's floor from the locked profile: the per-point floors beside it use the same measured ceilings
    floor_us = sum(p.floor_us or 0.0 for p in locked_profile.points)
    env = bench.environment()
    selection = {p: final["selection"].get(p, REFERENCE) for p in POINTS}
    entries = {}
    for point in POINTS:
        r = results.get(point)
        cand = r.candidate(selection[point], final["configs"].get(point)) if r else None
        timing = {"step_us": locked_point_us(r, selection[point], final["configs"].get(point)),
                  "reference_us": r.reference_us, "noise_band": r.band} if r else {}
        entries[point] = Lock.entry(point, selection[point], config=final["configs"].get(point), timing=timing,
                                    gate=(cand.gate if cand and cand.gate else {"passed": True, "reference": True}))
    lock = Lock(model={"preset": opts.preset, "config_hash": model.config.config_hash(), "dtype": dtype},
                target=opts.target, environment=env, points=entries, command=opts.command,
                created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                end_to_end={"reference_us": final["reference"]["median_us"],
                            "locked_us": final["locked"]["median_us"],
                            "torch_compile_us": compiled_us, "model_gate": final["model_gate"]})
    lock.save(os.path.join(opts.out_dir, "lock.yaml"))

    report = {
        "target": opts.target, "preset": opts.preset, "dtype": dtype, "gpu": env.get("gpu"),
        "command": opts.command, "environment": env,
        "step": {"batch": target.batch, "tokens_per_seq": target.tokens_per_seq, "context": target.context},
        "reference_ms": final["reference"]["median_us"] / 1e3,
        "locked_ms": final["locked"]["median_us"] / 1e3,
        "torch_compile_ms": compiled_us / 1e3 if compiled_us else None,
        "torch_compile_baseline": opts.compile_baselines[0],
        "torch_compile_left_out": not_compiled,
        **({"torch_compile_error": compile_error} if compile_error else {}),
        "torch_compile_baselines": [
            {"mode": mode, "ms": us / 1e3 if us else None, "speedup": us / final["locked"]["median_us"] if us else None,
             "left_out": left_out, **({"error": error} if error else {})}
            for mode, (us, left_out, error, *_) in ((m, baselines[m]) for m in opts.compile_baselines)],
        "timed_apart": timed_apart(final, {m: baselines[m] for m in opts.compile_baselines}),
        # choices the end-to-end rule dropped as noise, and the chosen set's step time before it did
        "dropped": final.get("dropped") or {},
        "before_drop_ms": final["before_drop"]["median_us"] / 1e3 if final.get("before_drop") else None,
        "step_band": final.get("band"),
        # the paired timing of the set with and without those choices that decided it (rule 3)
        "paired": final.get("paired"),
        # candidates tied with a point's choice at the op level, tried end to end (rule 4)
        "challenges": final.get("challenges") or {},
        "speedup": final["reference"]["median_us"] / final["locked"]["median_us"],
        "speedup_vs_torch_compile": compiled_us / final["locked"]["median_us"] if compiled_us else None,
        "floor_ms": floor_us / 1e3,
        "fraction_of_floor": floor_us / final["locked"]["median_us"] if floor_us else None,
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
    mark_run_by_compounds(report)
    report_path = os.path.join(opts.out_dir, "report.json")
    report["previous"] = against_previous(_read_json(report_path), report)
    _write_json(report_path, report)
    with open(os.path.join(opts.out_dir, "report.md"), "w") as f:
        f.write(report_markdown(report))
    on_event({"type": "done", "report": report})
    return report


def whole_step_baselines(search, opts: OptimizeOptions, key: dict, on_event) -> dict:
    """The whole-step torch.compile baselines of `opts.compile_baselines` (each [us, left out, error,
    process]), timed before the search and kept in compile_baselines.json. They compile the reference
    step only, so they hold for later searches of this folder (a re-lock after a kernel change) while
    the reference step and torch are the same, and a run stopped early in its search (`--budget 0`,
    e.g. on a GPU host whose kernel libraries are still being copied over) leaves them made: a
    max-autotune compile of the decode step takes minutes."""
    path = os.path.join(opts.out_dir, "compile_baselines.json")
    whole_key = {"profile": key, "torch": torch.__version__}
    whole = _saved(path, whole_key, lambda saved: saved["modes"]) or {}
    for mode in opts.compile_baselines:
        if mode != "points" and mode not in whole:
            on_event({"type": "stage", "stage": f"torch.compile ({mode}) of the whole reference step"})
            whole[mode] = [*time_compile_baseline(search, mode, {}), bench.PROCESS_ID]
            _write_json(path, {"key": whole_key, "modes": whole})
            from torch import _dynamo

            _dynamo.reset()  # the search's per-point compiles start from a clean compiler state
    return whole


def time_compile_baseline(search, baseline: str, results: dict) -> tuple[float | None, dict[str, str], str | None]:
    """The torch.compile build's step time (us), the points it keeps at their reference (why), and the
    error that left the baseline out. "points": a point whose compile fails here (a shape the search
    did not compile, a compiler bug) joins the points kept at their reference, and the build is timed
    again from a clean compiler state. The baseline is a row of the report: when it cannot be timed,
    the report says why (the traceback goes to stderr) and the lock is written all the same."""
    left_out = uncompilable(results) if baseline == "points" else {}
    while True:
        try:
            if baseline != "points":
                return search.time_build({}, compile_mode=baseline)["median_us"], {}, None
            return search.time_build({p: "torch_compile" for p in POINTS if p not in left_out})["median_us"], \
                left_out, None
        except Exception as e:
            point = _compiled_point(e) if baseline == "points" else None
            if point is None or point in left_out:
                traceback.print_exc()
                what = "of the whole step" if baseline != "points" else "of every point"
                return None, left_out, f"torch.compile ({baseline}) {what} failed: {bench._describe(e)}"
            left_out[point] = f"torch.compile failed in the end-to-end build ({bench._describe(e)})"
            import torch._dynamo

            torch._dynamo.reset()  # a failed compile may leave guards and caches half-built


def _compiled_point(error: BaseException) -> str | None:
    """The point whose torch.compile'd reference raised `error`, read off its traceback: the registry's
    compile wrapper (one code object for every point) holds the reference function it compiles."""
    wrapper = _compiled(len).__code__
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is wrapper:
            fn = tb.tb_frame.f_locals.get("fn")
            return next((p for p in POINTS if get(p, REFERENCE).fn is fn), None)
        tb = tb.tb_next
    return None


def uncompilable(results: dict) -> dict[str, str]:
    """Points whose torch_compile candidate the search saw fail, crash or stall, with why: the
    torch.compile build keeps their reference rather than compile them again (a compile that ran past
    the watchdog in the search would stall the end-to-end timing the same way)."""
    out = {}
    for point, r in results.items():
        c = next((c for c in r.candidates if c.variant == "torch_compile"), None)
        if c is not None and c.step_us is None:
            out[point] = c.skipped or (f"failed its gate: {c.failed_check}" if c.failed_check else "no time")
    return out


def backend_bests(result) -> dict[str, float]:
    """Each backend's fastest candidate that passed its gate at this point, in ms per step (the
    reference counts as torch): which backend won, and by how much over the others. Candidates
    launched with PDL count as "<backend>+pdl", so the report shows what PDL itself gained. A compound's
    reference row is timed as its members' choices run apart ("apart")."""
    best: dict[str, float] = {}
    for c in result.candidates:
        if c.step_us is not None and c.gate_passed:
            key = "apart" if result.point in COMPOUNDS and c.variant == REFERENCE else c.backend
            key += "+pdl" if (c.config or {}).get("pdl") else ""
            best[key] = min(best.get(key, math.inf), c.step_us / 1e3)
    return dict(sorted(best.items(), key=lambda kv: kv[1]))


def rerender(out_dir: str) -> dict:
    """Rewrite a finished run's report.json / report.md in the current format from its report.json and
    search/*.json (fields derived from the search results, and the step's floor from locked_profile.json,
    are recomputed); nothing is timed again."""
    path = os.path.join(out_dir, "report.json")
    with open(path) as f:
        report = json.load(f)
    locked_profile = _read_json(os.path.join(out_dir, "locked_profile.json"))
    if locked_profile:  # reports before session 18 summed the reference profile's floors (another run's ceilings)
        floor_us = sum(pp.get("floor_us") or 0.0 for pp in locked_profile["points"])
        report["floor_ms"] = floor_us / 1e3
        report["fraction_of_floor"] = floor_us / (report["locked_ms"] * 1e3) if floor_us else None
    for p in report["points"]:
        cached = os.path.join(out_dir, "search", f"{p['point']}.json")
        p["best_ms_by_backend"] = {}  # a point the run did not search
        if os.path.isfile(cached):
            with open(cached) as f:
                p["best_ms_by_backend"] = backend_bests(PointResult.from_dict(json.load(f)["result"]))
    mark_run_by_compounds(report)
    _write_json(path, report)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(report_markdown(report))
    return report


def mark_run_by_compounds(report: dict) -> None:
    """Each member of a compound point locked at a fused variant gets `run_by` ("attention_out:triton"):
    the locked build runs that variant's kernels in the member's place, so the member's own selection
    (left at its reference by the end-to-end stage: reverting it changed nothing) never runs."""
    members = run_by({p["point"]: p["variant"] for p in report["points"]})
    for p in report["points"]:
        p.pop("run_by", None)
        if p["point"] in members:
            p["run_by"] = members[p["point"]]


def _run_by_points(report: dict) -> dict[str, str]:
    """The `run_by` marks `mark_run_by_compounds` left on a report's points, by point."""
    return {p["point"]: p["run_by"] for p in report.get("points", []) if p.get("run_by")}


def against_previous(previous: dict | None, report: dict) -> dict | None:
    """What this lock changed against the one it replaces in the run folder (same target, preset,
    dtype and GPU): the locked step then, and each point whose variant or tuning config changed. A
    rerun that locks the same build keeps the comparison the previous report made."""
    if not previous or any(previous.get(k) != report[k] for k in ("target", "preset", "dtype", "gpu")):
        return None
    was = {p["point"]: p for p in previous.get("points", [])}

    def moved(p):  # a report from before points carried their config compares variants only
        old = was[p["point"]]
        return _choice(old) != (_choice(p) if "config" in old else p["variant"])
    changed = [{"point": p["point"], "was": _choice(was[p["point"]]), "was_ms": was[p["point"]].get("ms"),
                "now": _choice(p), "now_ms": p["ms"]}
               for p in report["points"] if p["point"] in was and moved(p)]
    if not changed and previous.get("locked_ms") == report["locked_ms"]:
        return previous.get("previous")  # the same lock written again (a resumed, finished run)
    return {"locked_ms": previous.get("locked_ms"), "git_commit": (previous.get("environment") or {}).get("git_commit"),
            "changed": changed}


def _fmt(x) -> str:
    return f"{x:.3f}" if isinstance(x, (int, float)) else "-"


def _against_previous_lines(previous: dict, locked_ms: float, run_by: dict[str, str] | None = None) -> list[str]:
    lines = ["", "## Against the lock this one replaced", "",
             f"Locked step: {_fmt(previous['locked_ms'])} ms then (commit {previous.get('git_commit')}), "
             f"{locked_ms:.3f} ms now."]
    if not previous["changed"]:  # same choices: the difference is the variants' code, or the device and the run
        lines[-1] += " No point's locked variant or config changed."
        return lines
    return lines + ["Points whose locked variant or config changed:", "",
                    "| point | was | ms/step | now | ms/step |", "| --- | --- | ---: | --- | ---: |",
                    *[f"| {c['point']} | {c['was']} | {_fmt(c['was_ms'])} | " +
                      (f"run by {run_by[c['point']]} | - |" if c["point"] in (run_by or {}) else
                       f"{c['now']} | {_fmt(c['now_ms'])} |")
                      for c in previous["changed"]]]


def _choice(point: dict) -> str:
    config = point.get("config")
    return point["variant"] + (f" {bench.config_text(config)}" if config else "")


def compile_baselines(r: dict) -> list[dict]:
    """A report's torch.compile rows; reports written before there could be several hold one."""
    if "torch_compile_baselines" in r:
        return r["torch_compile_baselines"]
    return [{"mode": r.get("torch_compile_baseline", "points"), "ms": r["torch_compile_ms"],
             "speedup": r["speedup_vs_torch_compile"], "left_out": r.get("torch_compile_left_out") or {},
             **({"error": r["torch_compile_error"]} if r.get("torch_compile_error") else {})}]


def timed_apart(final: dict, baselines: dict) -> list[str] | None:
    """The report's builds not timed in the locked build's process (a resumed run keeps the timings of
    earlier processes), whose ratios to it pair two processes; None when the locked build's process was
    not recorded (runs before the stamp). A build whose process was not recorded counts as apart."""
    locked = final["locked"].get("process")
    if locked is None:
        return None
    processes = {"reference": final["reference"].get("process"),
                 **{f"{p} reverted": q for p, q in (final.get("reverted_process") or {}).items()},
                 **({"the chosen set before the drop": final["before_drop"].get("process")}
                    if final.get("before_drop") else {}),
                 **{_compile_row(mode): b[3] if len(b) > 3 else None for mode, b in baselines.items()}}
    return [build for build, process in processes.items() if process != locked]


def noise_line(r: dict) -> str | None:
    """What the end-to-end rule did with the choices each reverted within the step's noise band: dropped
    together, or kept because a paired timing found the set faster with them (None: there were none)."""
    paired = r.get("paired")
    if not r.get("dropped") and not paired:
        return None
    run_by = _run_by_points(r)  # a member of a compound locked at a fused variant: its choice never ran
    choices = ", ".join(f"{p}:{v}" + (f" ({run_by[p]} runs in its place)" if p in run_by and r.get("dropped") else "")
                        for p, v in (r.get("dropped") or paired["choices"]).items())
    band = f" ({100 * r['step_band']:.1f}%)" if r.get("step_band") is not None else ""
    pairs = (f"; in a paired timing ({len(paired['rounds'])} alternating rounds) the set without them was "
             f"{slower_by(paired['gain'])}, band {100 * paired['band']:.2f}%" if paired else "")
    if not r.get("dropped"):
        return f"Kept at the end-to-end stage, each reverted within the step's noise band{band}: {choices}{pairs}."
    before = (f"; the chosen set with them timed {r['before_drop_ms']:.3f} ms, the locked set without them "
              f"{r['locked_ms']:.3f} ms" if r.get("before_drop_ms") else "")
    return f"Dropped at the end-to-end stage, each reverted within the step's noise band{band}: {choices}{pairs}{before}."


def locked_point_us(r, variant: str, config: dict | None) -> float:
    """The search's timing of the point at the locked variant and config: the choice's, or another
    candidate's when the end-to-end stage swapped it in (rule 4) or dropped the choice."""
    cand = r.candidate(variant, config)
    if cand is not None and cand.step_us is not None:
        return cand.step_us
    return r.reference_us if variant == REFERENCE else r.choice_us


def challenge_lines(r: dict) -> list[str]:
    """One line per candidate tried end to end against a point's choice (rule 4)."""
    lines = []
    for point, c in (r.get("challenges") or {}).items():
        what = f"{point}:{c['variant']}" + (f" {json.dumps(c['config'], sort_keys=True)}" if c.get("config") else "")
        head = (f"Tried end to end, tied with the choice at the op level: {what} ({c['op_us']:.1f} us/step "
                f"against the choice's {c['choice_op_us']:.1f})")
        if "gain" not in c:
            lines.append(f"{head}: fails the model gate in the set ({c.get('model_gate')}), not taken.")
        else:
            lines.append(f"{head}: with the choice the step was {paired_words(c)}: "
                         f"{'taken' if c['won'] else 'not taken'}.")
    return lines


def _compile_row(baseline: str) -> str:
    if baseline == "points":
        return "torch.compile (every point)"
    return f"torch.compile of the whole reference step ({baseline})"


def code_line(env: dict) -> str:
    """Which code ran: the commit, and when the files differed from it (uncommitted edits, or a copy of
    the tree whose .git is older than its files, as on the GPU host) the tree they hash to, the name
    that then identifies them."""
    line = f"commit {env.get('git_commit')}"
    if env.get("git_dirty"):
        line += ", files changed since"
    return line + (f" (files: git tree {env['git_tree']})" if env.get("git_tree") else "")


def report_markdown(r: dict) -> str:
    idle = idle_line(r.get("locked_idle"))
    cost = bool(r.get("in_step"))  # each point's cost in the running step, timed (`--in-step`)
    lines = [
        f"# optimize {r['target']} on {r['preset']} ({r['dtype']})", "",
        f"Command: `{r['command']}`", "",
        f"Device: {r['gpu'] or 'cpu'}; torch {r['environment'].get('torch')}, "
        f"triton {r['environment'].get('triton')}; {code_line(r['environment'])}", "",
        "| build | step ms | speed-up of locked |", "| --- | ---: | ---: |",
        f"| reference | {r['reference_ms']:.3f} | {r['speedup']:.2f}x |",
        *[f"| {_compile_row(b['mode'])} | " + (f"{b['ms']:.3f} | {b['speedup']:.2f}x |" if b["ms"] else "failed | |")
          for b in compile_baselines(r)],
        f"| locked | {r['locked_ms']:.3f} | |", "",
        *(["Timed in a process other than the locked build's (a resumed run; their ratios to it pair two "
           "processes): " + ", ".join(r["timed_apart"]), ""] if r.get("timed_apart") else []),
        *([line, ""] if (line := noise_line(r)) else []),
        *[line for c in challenge_lines(r) for line in (c, "")],
        *[line for b in compile_baselines(r) for line in ([b["error"], ""] if b.get("error") else [])],
        *[line for b in compile_baselines(r) for p, why in (b.get("left_out") or {}).items()
          for line in (f"The torch.compile build keeps the reference at {p}: {why}", "")],
        f"Roofline floor of the step: {r['floor_ms']:.3f} ms"
        + (f" (locked step at {100 * r['fraction_of_floor']:.0f}% of floor speed)" if r["fraction_of_floor"] else ""),
        "", f"Kernels per layer: reference {r['kernels_per_layer']['reference']}, "
            f"locked {r['kernels_per_layer']['locked']}", "",
        *([f"In the locked step's profile (eager, under the profiler): {idle} (`locked_profile.json`, `idle`)", ""]
          if idle else []),
        "ms/step: the search's timing of the point at the step's shapes; in the locked step: the profiler's "
        "device time of the point in one locked step (`locked_profile.json`), beside its floor"
        + ("; cost in the running step: the locked step's time less its time with the point replaced by a stand-in "
           "that launches no kernel (`in_step.json`, best of "
           f"{r['in_step']['rounds']} rounds, the step {r['in_step']['step_ms']:.3f} ms there): what the point costs "
           "as the step runs, overlap included, and the most a fusion of it could save." if cost else "."), "",
        "| point | locked variant | backend | ms/step | reference ms/step | in the locked step, ms | "
        + ("cost in the running step, ms | " if cost else "") + "floor ms "
        "| step ms with it reverted | fastest gated candidate of each backend, ms/step |",
        "| --- | --- | --- | ---: | ---: | ---: | " + ("---: | " if cost else "") + "---: | ---: | --- |",
    ]
    for p in r["points"]:
        bests = ", ".join(f"{b} {ms:.3f}" for b, ms in (p.get("best_ms_by_backend") or {}).items()) or "-"
        in_step = f"{_fmt(p.get('in_step_ms'))} | " if cost else ""
        if p.get("run_by"):  # its own selection never runs in the locked build: no timing of it
            lines.append(f"| {p['point']} | run by {p['run_by']} | - | - | {_fmt(p['reference_ms'])} | - | "
                         f"{'- | ' if cost else ''}- | - | {bests} |")
            continue
        lines.append(f"| {p['point']} | {p['variant']} | {p['backend']} | {_fmt(p['ms'])} | "
                     f"{_fmt(p['reference_ms'])} | {_fmt(p.get('locked_step_ms'))} | {in_step}"
                     f"{_fmt(p.get('floor_ms'))} | {_fmt(p['reverted_ms'])} | {bests} |")
    if r.get("previous"):
        lines += _against_previous_lines(r["previous"], r["locked_ms"], _run_by_points(r))
    return "\n".join(lines) + "\n"
