"""`workbench optimize` end to end on beam-tiny (CPU) (workbench/optimize.py): profile -> search -> lock ->
report, every result file written, and each stage resumed from the run folder."""

import json
import os
import shutil

import pytest
from harness_helpers import POINTS_SEARCHED, tiny_options

from workbench import compile_baseline, timing
from workbench.end_to_end import EndToEnd
from workbench.events import (
    CandidateTried,
    EndToEndResumed,
    InStepLine,
    PointCached,
    PointDone,
    PointStarted,
    StageStarted,
)
from workbench.optimize import OptimizeOptions, optimize
from workbench.registry import COMPOUNDS, DRAFTER_POINTS, POINTS
from workbench.targets import for_device, get_target


def test_run_writes_every_result_file(finished_run):
    out, report, events = finished_run
    for name in ("lock.yaml", "report.json", "report.md", "profile.json", "profile.trace.json",
                 "locked_profile.json", "locked_profile.trace.json"):
        assert os.path.isfile(os.path.join(out, name)), name
    with open(os.path.join(out, "report.json")) as f:
        saved = json.load(f)
    for key in ("target", "preset", "dtype", "gpu", "reference_ms", "locked_ms", "speedup", "floor_ms",
                "torch_compile_ms", "kernels_per_layer", "points"):
        assert key in saved, key
    assert saved["speedup"] == pytest.approx(saved["reference_ms"] / saved["locked_ms"])
    assert saved["timed_apart"] == []  # every build and baseline timed in this one process
    assert {p["point"] for p in saved["points"]} == set(POINTS)
    searched = [e.point for e in events if isinstance(e, PointDone)]
    assert sorted(searched) == sorted(POINTS_SEARCHED)
    # every candidate of a searched point was gated before it was timed
    for e in events:
        if isinstance(e, CandidateTried) and e.result.step_us is not None:
            assert e.result.gate_passed
            assert e.result.seconds > 0  # its wall time, first-use builds included
    # the locked step as the profiler saw it: every point's device time there, and its floor
    with open(os.path.join(out, "locked_profile.json")) as f:
        locked = {pp["point"]: pp for pp in json.load(f)["points"]}
    for p in saved["points"]:
        if p["point"] in DRAFTER_POINTS:  # a decode step runs no drafter: listed, never profiled
            assert p["point"] not in locked and p["locked_step_ms"] is None
            continue
        assert p["locked_step_ms"] == pytest.approx(locked[p["point"]]["time_us"] / 1e3)
        assert locked[p["point"]]["variant"] == p["variant"]
        if p["point"] in COMPOUNDS and p["variant"] == "torch":  # run apart: its members hold time and floor
            assert p["floor_ms"] is None and p["locked_step_ms"] == 0
        else:
            assert p["floor_ms"] > 0
    # which backend won each searched point, and by how much: each backend's fastest gated candidate
    for p in saved["points"]:
        bests = p["best_ms_by_backend"]
        if p["point"] in POINTS_SEARCHED:
            assert bests["torch"] <= p["reference_ms"] + 1e-12 and list(bests.values()) == sorted(bests.values())
        else:
            assert bests == {}


def test_spent_budget_stops_between_points_and_the_run_resumes(finished_run, tmp_path):
    out, _, _ = finished_run
    fresh = optimize(tiny_options(tmp_path / "fresh", budget_s=0.0))
    assert fresh["stopped"] and sorted(fresh["pending"]) == sorted(POINTS_SEARCHED) and fresh["searched"] == []
    assert not os.path.exists(tmp_path / "fresh" / "lock.yaml")

    # A run folder holding every point's search result finishes even with no budget left: nothing new to search.
    shutil.copytree(os.path.join(out, "search"), tmp_path / "resumed" / "search")
    events = []
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        report = optimize(tiny_options(tmp_path / "resumed", budget_s=0.0), on_event=events.append)
    assert not report.get("stopped")
    assert sorted(e.point for e in events if isinstance(e, PointCached)) == sorted(POINTS_SEARCHED)
    assert not any(isinstance(e, PointStarted) for e in events)
    assert os.path.isfile(tmp_path / "resumed" / "lock.yaml")


def test_a_resumed_run_settles_its_cached_points_before_searching(finished_run, tmp_path):
    """Whatever the ranking, a point the run folder holds is settled before any point still to search,
    so a spent budget (or a pause) stops only work still to do."""
    out, _, _ = finished_run
    stages = []
    optimize(tiny_options(tmp_path / "fresh", budget_s=0.0), on_event=stages.append)
    first, *rest = next(e.order for e in stages if isinstance(e, StageStarted) and e.stage == "search")
    assert rest, "the test needs two points searched"
    os.makedirs(tmp_path / "resumed" / "search")
    for p in rest:  # every point but the one ranked first
        shutil.copy(os.path.join(out, "search", f"{p}.json"), tmp_path / "resumed" / "search")
    events = []
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        report = optimize(tiny_options(tmp_path / "resumed", budget_s=0.0), on_event=events.append)
    assert report["stopped"] and report["pending"] == [first] and report["searched"] == rest
    assert [e.point for e in events if isinstance(e, PointCached)] == rest
    assert next(e.order for e in events if isinstance(e, StageStarted) and e.stage == "search") == [*rest, first]


def test_a_resumed_run_reuses_its_reference_profile(finished_run, tmp_path, monkeypatch):
    """profile.json and end_to_end.json carry what they depend on; a resumed run with the same key
    profiles only the locked build and reuses the end-to-end timings, another key (here the weights'
    seed) profiles the reference and times the builds again."""
    from workbench import optimize as optmod
    from workbench.optimize import profile_key
    from workbench.profiler.attribution import Profile
    from workbench.run_folder import RunFolder

    def _saved_profile(folder, key):
        return RunFolder(folder).saved(RunFolder.PROFILE, key, Profile.from_dict)

    out, _, _ = finished_run
    resumed = str(tmp_path / "resumed")
    shutil.copytree(out, resumed)
    opts = tiny_options(resumed)
    target = for_device(get_target("decode-b1"), opts.device)
    key = profile_key(opts, "fp32", lambda kind: target.workload("beam-tiny", "fp32", kind))
    assert _saved_profile(resumed, key).to_dict()["points"] == _saved_profile(out, key).to_dict()["points"]
    assert _saved_profile(resumed, {**key, "seed": 1}) is None and _saved_profile(str(tmp_path), key) is None
    real, calls = optmod.profile_step, []
    monkeypatch.setattr(optmod, "profile_step", lambda *a, **kw: calls.append(kw.get("trace_path")) or real(*a, **kw))
    real_finalize, finalized = EndToEnd.finalize, []
    monkeypatch.setattr(EndToEnd, "finalize", lambda self, r, **kw: finalized.append(1) or real_finalize(self, r, **kw))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    first = optimize(opts)
    locked_trace = os.path.join(resumed, "locked_profile.trace.json")
    assert calls == [locked_trace]  # the locked build's profile only
    assert finalized == []  # and the end-to-end builds' timings and gate from end_to_end.json
    _, report, _ = finished_run
    assert first["locked_ms"] == report["locked_ms"] and first["reference_ms"] == report["reference_ms"]
    optimize(OptimizeOptions(**{**opts.__dict__, "seed": 1}))
    assert calls[1:] == [os.path.join(resumed, "profile.trace.json"), locked_trace] and finalized == [1]


def test_a_relock_reports_what_changed_against_the_lock_it_replaced(finished_run, tmp_path, monkeypatch):
    """A re-lock in a run folder compares itself with the report it replaces: the locked step then
    and now, and each point whose locked variant or config changed; a rerun that locks the same
    build again keeps that comparison."""
    resumed = str(tmp_path / "resumed")
    shutil.copytree(finished_run[0], resumed)
    path = os.path.join(resumed, "report.json")
    with open(path) as f:
        old = json.load(f)
    old["locked_ms"] = 99.0
    moved = next(p for p in old["points"] if p["point"] == "boundary")
    was = dict(moved)
    moved.update(variant="planted", config={"num_warps": 2}, ms=1.5)
    with open(path, "w") as f:
        json.dump(old, f)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    opts = tiny_options(resumed)
    previous = optimize(opts)["previous"]
    assert previous["locked_ms"] == 99.0
    assert [c["point"] for c in previous["changed"]] == ["boundary"]
    assert previous["changed"][0]["was"] == 'planted {"num_warps":2}' and previous["changed"][0]["was_ms"] == 1.5
    assert previous["changed"][0]["now"].startswith(was["variant"])
    with open(os.path.join(resumed, "report.md")) as f:
        assert "## Against the lock this one replaced" in f.read()
    assert optimize(opts)["previous"] == previous  # the same lock again


def test_a_run_ended_in_the_end_to_end_stage_resumes_its_builds(finished_run, tmp_path, monkeypatch):
    """optimize keeps each end-to-end build in end_to_end.json as it is made: a run that a command's
    limit ends there (here, once the model gate and the reference build are saved) keeps both, and the
    same command then makes neither again and writes the lock."""
    from workbench import gates, run_folder

    resumed = str(tmp_path / "resumed")
    shutil.copytree(finished_run[0], resumed)
    os.remove(os.path.join(resumed, "end_to_end.json"))
    real_write, real_time, real_gate = run_folder.write_json, EndToEnd.time_build, gates.model_gate
    timed, gated, ended = [], [], []

    def write(path, obj, **kw):
        real_write(path, obj, **kw)
        if len(obj.get("journal", ())) == 2 and not ended:
            ended.append(1)
            raise TimeoutError("the command's time limit")

    monkeypatch.setattr(run_folder, "write_json", write)

    def time_build(self, selection, configs=None, **kw):
        # builds timed alone: a paired timing's rounds (their own budget, one journal entry) time the
        # reference build again when every choice is within the noise
        if "budget_s" not in kw:
            timed.append(dict(selection))
        return real_time(self, selection, configs, **kw)

    monkeypatch.setattr(EndToEnd, "time_build", time_build)
    monkeypatch.setattr(gates, "model_gate", lambda model, selection, **kw: gated.append(dict(selection)) or
                        real_gate(model, selection, **kw))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(timing, "PROCESS_ID", "first-command")
    opts = tiny_options(resumed)
    with pytest.raises(TimeoutError):
        optimize(opts)
    assert timed == [{}] and len(gated) == 1  # the chosen set's model gate, then the reference build
    events = []
    monkeypatch.setattr(timing, "PROCESS_ID", "second-command")
    report = optimize(opts, on_event=events.append)
    assert EndToEndResumed(builds=2) in events
    assert {} not in timed[1:] and gated[0] not in gated[1:]  # neither made again
    assert report["locked_ms"] > 0 and os.path.isfile(os.path.join(resumed, "lock.yaml"))
    # The reference was timed by the first command, every other build by the second. The locked build
    # is the reference when every choice was dropped as noise on this CPU (the set before the drop is
    # then the second's); a chosen set of one point reverted is the reference build too (which set
    # this CPU chose varies from run to run).
    with open(os.path.join(resumed, "end_to_end.json")) as f:
        final = json.load(f)["final"]
    reverted = [f"{p} reverted" for p in final["reverted_process"]]
    first = ["reference"] + (reverted if len(reverted) == 1 else [])
    second = ([] if len(reverted) == 1 else reverted) + \
        (["the chosen set before the drop"] if final["before_drop"] else []) + ["torch.compile (every point)"]
    apart = first if final["locked"]["process"] == "second-command" else second
    assert [final["reference"]["process"], *final["reverted_process"].values()] == \
        ["first-command"] + (["first-command"] if len(reverted) == 1 else ["second-command"] * len(reverted))
    assert report["timed_apart"] == apart
    with open(os.path.join(resumed, "report.md")) as f:
        assert "Timed in a process other than the locked build's (a resumed run; their ratios to it pair two " \
               f"processes): {', '.join(apart)}" in f.read()


def test_every_compile_baseline_is_a_report_row_and_is_kept_for_a_resumed_run(finished_run, tmp_path, monkeypatch):
    """`--compile-baseline points max-autotune-no-cudagraphs plain-default`: one row each in the report (the
    issue's baseline beside every point's torch_compile, and the step of the fastest plain-PyTorch variants,
    naming them); each is saved to end_to_end.json once timed, so a
    resumed run times none again (a whole-step max-autotune compile takes minutes), and the whole-step
    one is kept for later re-locks of the folder."""

    resumed = str(tmp_path / "resumed")
    shutil.copytree(finished_run[0], resumed)  # its end_to_end.json holds the "points" baseline
    timed = []
    monkeypatch.setattr(compile_baseline, "time_compile_baseline", lambda search, mode, results: timed.append(mode) or
                        (None, {}, f"torch.compile ({mode}) of the whole step failed: planted"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    opts = tiny_options(resumed, compile_baselines=("points", "max-autotune-no-cudagraphs", "plain-default"))
    report = optimize(opts)
    assert timed == ["max-autotune-no-cudagraphs", "plain-default"]
    assert [b["mode"] for b in report["torch_compile_baselines"]] == ["points", "max-autotune-no-cudagraphs",
                                                                      "plain-default"]
    assert report["torch_compile_ms"] == finished_run[1]["torch_compile_ms"]  # the first row fills the old fields
    plain = report["torch_compile_baselines"][2]["variants"]  # what the plain build ran instead of references
    assert set(plain) <= {"qkvg_proj"} and set(plain.values()) <= {"packed", "packed_views"}
    with open(os.path.join(resumed, "report.md")) as f:
        md = f.read()
    assert "| torch.compile (every point) |" in md
    assert "| torch.compile of the whole reference step (max-autotune-no-cudagraphs) | failed | |" in md
    assert "torch.compile (max-autotune-no-cudagraphs) of the whole step failed: planted" in md
    assert "| torch.compile of the whole step from the fastest plain-PyTorch variants (default) | failed | |" in md
    assert "The plain-PyTorch torch.compile build (plain-default) runs " in md
    optimize(opts)
    assert timed == ["max-autotune-no-cudagraphs", "plain-default"]
    # A re-lock after a kernel change (here: end_to_end.json gone) times every build that depends on the
    # search again, and reuses the whole reference step's compile, which did not change.
    os.remove(os.path.join(resumed, "end_to_end.json"))
    optimize(opts)
    assert timed == ["max-autotune-no-cudagraphs", "plain-default", "points", "plain-default"]


def test_a_run_without_compile_baselines_reports_and_locks_without_them(finished_run, tmp_path, monkeypatch):
    """`--compile-baseline none`: no torch.compile build is timed; the report and the lock say so (no
    row, no figure) instead of failing."""
    from workbench.lock import Lock

    resumed = str(tmp_path / "resumed")
    shutil.copytree(finished_run[0], resumed)
    monkeypatch.setattr(compile_baseline, "time_compile_baseline", lambda *a: pytest.fail("a baseline was timed"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    opts = tiny_options(resumed, compile_baselines=())
    report = optimize(opts)
    assert report["torch_compile_baselines"] == [] and report["torch_compile_ms"] is None
    with open(os.path.join(resumed, "report.md")) as f:
        assert "| torch.compile" not in f.read()  # the builds table: reference and locked only
    assert Lock.load(os.path.join(resumed, "lock.yaml"))[0].end_to_end["torch_compile_us"] is None


def test_whole_step_baselines_are_made_before_the_search(tmp_path, monkeypatch):
    """A whole-step baseline compiles the reference step only: a run stopped before its first point
    (`--budget 0`, a GPU host whose kernel libraries have not all arrived) leaves it made and kept."""

    timed = []
    monkeypatch.setattr(compile_baseline, "time_compile_baseline", lambda search, mode, results: timed.append(mode) or
                        (1234.0, {}, None))
    out = str(tmp_path / "stopped")
    opts = tiny_options(out, budget_s=0.0, compile_baselines=("points", "max-autotune-no-cudagraphs",
                                                               "plain-max-autotune-no-cudagraphs"))
    assert optimize(opts)["stopped"] and timed == ["max-autotune-no-cudagraphs"]  # the plain one needs the search
    assert not os.path.exists(os.path.join(out, "search"))
    with open(os.path.join(out, "compile_baselines.json")) as f:
        assert f.read().count("1234.0") == 1


def test_sigterm_stops_the_optimize_command_as_ctrl_c_does(tmp_path, monkeypatch, capsys):
    """A time limit's SIGTERM reaches the search as KeyboardInterrupt (so the candidate in flight is
    recorded as stopped, not hung); the command says how to resume and exits 130."""
    import signal

    from workbench import optimize as optmod
    from workbench.cli import main

    def killed(opts, on_event=None):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the run")
    monkeypatch.setattr(optmod, "optimize", killed)
    def unhandled(*_):
        raise AssertionError("the command left SIGTERM to end the process")
    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        assert main(["optimize", "--device", "cpu", "--out", str(tmp_path / "run")]) == 130
        assert signal.getsignal(signal.SIGTERM) is unhandled  # the process's own handler is back
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert f"stopped. Run the same command to resume from {tmp_path / 'run'}" in capsys.readouterr().err


def test_in_step_costs_are_a_report_column(finished_run, tmp_path, monkeypatch):
    """`--in-step`: after the lock, the locked step against it with each point stood in for; each point's
    cost lands in report.json and in a report.md column, and the run folder keeps in_step.json."""
    out, _, _ = finished_run
    resumed = str(tmp_path / "in-step")
    shutil.copytree(out, resumed)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    events = []
    report = optimize(tiny_options(resumed, in_step_s=0.01), on_event=events.append)
    with open(os.path.join(resumed, "in_step.json")) as f:
        costs = json.load(f)["costs"]
    by_point = {p["point"]: p for p in report["points"]}
    for point, c in costs.items():
        assert by_point[point]["in_step_ms"] == c["cost_ms"]
    assert by_point["attention"]["in_step_ms"] is None  # no stand-in: its compound's stands in for it
    assert report["in_step"]["rounds"] == 2 and any(isinstance(e, InStepLine) for e in events)
    md = open(os.path.join(resumed, "report.md")).read()
    header = next(line for line in md.splitlines() if line.startswith("| point |"))
    assert "cost in the running step, ms" in header
    boundary = next(line for line in md.splitlines() if line.startswith("| boundary |"))
    assert boundary.count("|") == header.count("|") and f"| {costs['boundary']['cost_ms']:.3f} |" in boundary
    # without it, no column
    assert "cost in the running step" not in open(os.path.join(out, "report.md")).read()
