"""`workbench optimize` end to end on beam-tiny (CPU): profile -> search -> lock -> report, then the
lock verifies, and every kind of tampering is named by `lock verify`."""

import json
import os
import shutil

import pytest
import torch
import yaml

from workbench import bench
from workbench import lock as lockmod
from workbench.lock import Lock, verify
from workbench.optimize import OptimizeOptions, optimize
from workbench.registry import COMPOUNDS, POINTS
from workbench.targets import for_device, get_target

POINTS_SEARCHED = ("boundary", "qkvg_proj")


def _tiny_runner():
    """A decode-b1 step of beam-tiny in FP32 on the CPU: what the search tests build a Search on."""
    from beam_model import BeamForCausalLM
    from workbench.targets import StepRunner, for_device, get_target

    model = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32)
    return StepRunner(model, for_device(get_target("decode-b1"), model.device))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("opt"))
    events = []
    with pytest.MonkeyPatch.context() as mp:
        # As a user's CPU run: interpreted Triton kernels are for correctness tests, not for timing.
        mp.delenv("TRITON_INTERPRET", raising=False)
        report = optimize(OptimizeOptions(target="decode-b1", preset="beam-tiny", dtype=torch.float32,
                                          device=torch.device("cpu"), out_dir=out, points=POINTS_SEARCHED,
                                          command="pytest"), on_event=events.append)
    return out, report, events


def test_run_writes_every_result_file(run):
    out, report, events = run
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
    searched = [e["point"] for e in events if e["type"] == "point_done"]
    assert sorted(searched) == sorted(POINTS_SEARCHED)
    # every candidate of a searched point was gated before it was timed
    for e in events:
        if e["type"] == "candidate" and e["result"]["step_us"] is not None:
            assert e["result"]["gate_passed"]
            assert e["result"]["seconds"] > 0  # its wall time, first-use builds included
    # the locked step as the profiler saw it: every point's device time there, and its floor
    with open(os.path.join(out, "locked_profile.json")) as f:
        locked = {pp["point"]: pp for pp in json.load(f)["points"]}
    for p in saved["points"]:
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


def test_report_rerenders_from_the_run_folder(run, tmp_path):
    import shutil

    from workbench.optimize import rerender

    out, _, _ = run
    copy = str(tmp_path / "run")
    shutil.copytree(out, copy)
    with open(os.path.join(copy, "report.md")) as f:
        written = f.read()
    with open(os.path.join(copy, "report.json")) as f:
        old = json.load(f)
    for p in old["points"]:
        p.pop("best_ms_by_backend")  # as a report written before that field existed
    with open(os.path.join(copy, "report.json"), "w") as f:
        json.dump(old, f)
    assert rerender(copy)["points"] == run[1]["points"]
    with open(os.path.join(copy, "report.md")) as f:
        assert f.read() == written


def test_the_step_floor_is_the_locked_profiles_sum_of_point_floors(run, tmp_path):
    """The step's floor and the per-point floors beside it come from one profile, so from one set of
    measured ceilings (a resumed run's reference profile may be another host start's). A report that
    summed the reference profile's floors is set right when re-rendered."""
    import shutil

    from workbench.optimize import rerender

    out, report, _ = run
    assert report["floor_ms"] == pytest.approx(sum(p["floor_ms"] or 0.0 for p in report["points"]))
    copy = str(tmp_path / "run")
    shutil.copytree(out, copy)
    with open(os.path.join(copy, "report.json")) as f:
        old = json.load(f)
    old["floor_ms"], old["fraction_of_floor"] = 2 * report["floor_ms"], 2 * report["fraction_of_floor"]
    with open(os.path.join(copy, "report.json"), "w") as f:
        json.dump(old, f)
    again = rerender(copy)
    assert again["floor_ms"] == pytest.approx(report["floor_ms"])
    assert again["fraction_of_floor"] == pytest.approx(report["floor_ms"] / report["locked_ms"])


def test_lock_selects_the_variants_in_the_model(run):
    out, report, _ = run
    lock, problems = Lock.load(os.path.join(out, "lock.yaml"))
    assert problems == []
    assert set(lock.points) == set(POINTS)
    from beam_model import BeamForCausalLM

    model = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32, variants=lock.selection)
    assert model.ops.selection == lock.selection


def test_the_gate_evidence_locked_is_the_chosen_configs():
    from workbench.search import CandidateResult, PointResult

    def gated(block):
        return CandidateResult("boundary", "triton", "triton", {"block": block}, True,
                               gate={"subject": f"boundary:triton {{'block': {block}}}", "passed": True})

    r = PointResult("boundary", "triton", {"block": 8}, 10.0, 5.0, 0.02, [gated(4), gated(8)])
    assert r.candidate("triton", {"block": 8}).gate["subject"].endswith("{'block': 8}")
    assert r.candidate("triton", {"block": 16}) is None and r.candidate("torch", None) is None
    for run_dir in ("optimize-decode-b1-beam-501b-tp8", "optimize-prefill-8x2k-beam-501b-tp8"):
        lock, _ = Lock.load(os.path.join(os.path.dirname(__file__), "..", "runs", run_dir, "lock.yaml"))
        for point, entry in lock.points.items():  # the committed locks' evidence names each locked config
            if entry.get("config"):
                assert str(entry["config"]) in entry["gate"]["subject"], (run_dir, point)


def test_lock_verifies(run):
    out, _, _ = run
    result = verify(os.path.join(out, "lock.yaml"), run_gates=True)
    assert result.ok, result.problems


def _tampered(out, tmp_path, edit):
    with open(os.path.join(out, "lock.yaml")) as f:
        raw = yaml.safe_load(f)
    edit(raw)
    path = tmp_path / "lock.yaml"
    with open(path, "w") as f:
        yaml.safe_dump(raw, f)
    return str(path)


def test_lock_show_names_the_fusion_that_runs_a_members_work(run, tmp_path, capsys, monkeypatch):
    """`workbench lock show`: with attention_out locked at a fused variant, attention's and attn_out's
    rows say what runs in their place, not the reference variant left in their entries."""
    from workbench.cli import main

    monkeypatch.setenv("COLUMNS", "300")
    out, _, _ = run
    path = _tampered(out, tmp_path, lambda raw: raw["points"].update(
        attention_out={**raw["points"].get("attention_out", raw["points"]["attention"]), "variant": "triton"},
        attention={**raw["points"]["attention"], "variant": "torch"}))
    main(["lock", "show", path])
    rows = {line.split("│")[1].strip(): line for line in capsys.readouterr().out.splitlines() if line.count("│") > 3}
    assert "run by attention_out:triton" in rows["attention"] and "run by attention_out:triton" in rows["attn_out"]
    assert "run by" not in rows["boundary"] and "run by" not in rows["attention_out"]
    main(["lock", "show", os.path.join(out, "lock.yaml")])  # the fixture's lock: no fusion selected
    assert "run by" not in capsys.readouterr().out


def test_edited_timing_is_detected(run, tmp_path):
    out, _, _ = run
    path = _tampered(out, tmp_path, lambda raw: raw["end_to_end"].update(locked_us=0.001))
    result = verify(path, run_gates=False)
    assert not result.ok and any("digest" in p for p in result.problems)


def test_missing_point_is_detected(run, tmp_path):
    out, _, _ = run
    path = _tampered(out, tmp_path, lambda raw: raw["points"].pop("experts"))
    result = verify(path, run_gates=False)
    assert any("points missing" in p and "experts" in p for p in result.problems)


def test_changed_variant_source_is_detected(run, monkeypatch):
    out, _, _ = run
    real = lockmod.source_hash
    monkeypatch.setattr(lockmod, "source_hash",
                        lambda point, name: "0" * 16 if point == "boundary" else real(point, name))
    result = verify(os.path.join(out, "lock.yaml"), run_gates=False)
    assert any(p.startswith("boundary: source of") for p in result.problems), result.problems


def test_verify_names_the_file_that_changed(run, monkeypatch):
    """A lock records each covered file's hash: a kernel module edited under a point names itself,
    not just the point's module (a variant's hash covers every module its point's module imports)."""
    out, _, _ = run
    real_files, real_hash = lockmod.source_files, lockmod.source_hash
    kernel = "workbench/variants/_cute_boundary.py"  # imported by boundary.py only

    def edited(point, name):
        files = real_files(point, name)
        return {**files, kernel: "f" * 16} if kernel in files else files

    monkeypatch.setattr(lockmod, "source_files", edited)
    monkeypatch.setattr(lockmod, "source_hash", lambda point, name: "0" * 16 if kernel in real_files(point, name)
                        else real_hash(point, name))
    problems = verify(os.path.join(out, "lock.yaml"), run_gates=False).problems
    named = [p for p in problems if "source of" in p]
    assert named and all(p.endswith(f": {kernel} (edited)") for p in named), problems


def test_a_change_to_tuning_config_lists_only_leaves_a_lock_of_a_named_config_valid(run, tmp_path, monkeypatch):
    """Adding a tuning config to a variant's module used to make every lock of that module stale,
    though a lock entry names the config it runs. A lock keeps each variant's code key (the covered
    files' code without their config lists): a change to config lists only is a note, not a
    problem. Other code changes, and an entry running the default config (read off such a list, it
    may be), still need the whole source hash."""
    lock, _ = Lock.load(os.path.join(run[0], "lock.yaml"))
    lock.points["boundary"]["config"] = {"BLOCK": 64}  # as a searched config would be
    path = str(tmp_path / "lock.yaml")
    lock.save(path)
    real_hash, real_key = lockmod.source_hash, lockmod.code_key
    monkeypatch.setattr(lockmod, "source_hash",
                        lambda point, name: "0" * 16 if point == "boundary" else real_hash(point, name))
    result = verify(path, run_gates=False)
    assert result.ok and len(result.notes) == 1, result.problems
    assert result.notes[0].startswith("boundary: source of") and "tuning-config lists only" in result.notes[0]
    monkeypatch.setattr(lockmod, "code_key", lambda point, name, **kw:
                        "1" * 16 if point == "boundary" else real_key(point, name, **kw))
    assert [p for p in verify(path, run_gates=False).problems if p.startswith("boundary: source of")]
    monkeypatch.setattr(lockmod, "code_key", real_key)
    lock.points["boundary"]["config"] = None
    lock.save(path)
    result = verify(path, run_gates=False)
    assert result.notes == [] and [p for p in result.problems if p.startswith("boundary: source of")]


def test_other_environment_is_refused_for_serving(run):
    out, _, _ = run
    path = os.path.join(out, "lock.yaml")
    result = verify(path, environment={"gpu": "NVIDIA B200"}, run_gates=False)
    assert any(p.startswith("environment gpu") for p in result.problems)


def test_broken_lock_files_name_the_problem(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("points: [unclosed")
    with pytest.raises(lockmod.LockError, match="not valid YAML"):
        Lock.load(str(bad))
    bad.write_text("schema: 1\n")
    with pytest.raises(lockmod.LockError, match="lacks the fields"):
        Lock.load(str(bad))
    with pytest.raises(lockmod.LockError, match="no lock file"):
        Lock.load(str(tmp_path / "absent.yaml"))


def test_spent_budget_stops_between_points_and_the_run_resumes(run, tmp_path):
    out, _, _ = run
    opts = dict(target="decode-b1", preset="beam-tiny", dtype=torch.float32, device=torch.device("cpu"),
                points=POINTS_SEARCHED, command="pytest", budget_s=0.0)
    fresh = optimize(OptimizeOptions(out_dir=str(tmp_path / "fresh"), **opts))
    assert fresh["stopped"] and sorted(fresh["pending"]) == sorted(POINTS_SEARCHED) and fresh["searched"] == []
    assert not os.path.exists(tmp_path / "fresh" / "lock.yaml")

    # A run folder holding every point's search result finishes even with no budget left: nothing new to search.
    import shutil

    shutil.copytree(os.path.join(out, "search"), tmp_path / "resumed" / "search")
    events = []
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        report = optimize(OptimizeOptions(out_dir=str(tmp_path / "resumed"), **opts), on_event=events.append)
    assert not report.get("stopped")
    assert sorted(e["point"] for e in events if e["type"] == "point_cached") == sorted(POINTS_SEARCHED)
    assert not any(e["type"] == "point_start" for e in events)
    assert os.path.isfile(tmp_path / "resumed" / "lock.yaml")


def test_a_resumed_run_reuses_its_reference_profile(run, tmp_path, monkeypatch):
    """profile.json and end_to_end.json carry what they depend on; a resumed run with the same key
    profiles only the locked build and reuses the end-to-end timings, another key (here the weights'
    seed) profiles the reference and times the builds again."""
    import shutil

    from workbench import optimize as optmod
    from workbench.optimize import _profile_key, _saved
    from workbench.profiler.attribution import Profile

    def _saved_profile(folder, key):
        return _saved(os.path.join(folder, "profile.json"), key, Profile.from_dict)

    out, _, _ = run
    resumed = str(tmp_path / "resumed")
    shutil.copytree(out, resumed)
    opts = OptimizeOptions(target="decode-b1", preset="beam-tiny", dtype=torch.float32, device=torch.device("cpu"),
                           out_dir=resumed, points=POINTS_SEARCHED, command="pytest")
    target = for_device(get_target("decode-b1"), opts.device)
    key = _profile_key(opts, "fp32", lambda kind: target.workload("beam-tiny", "fp32", kind))
    assert _saved_profile(resumed, key).to_dict()["points"] == _saved_profile(out, key).to_dict()["points"]
    assert _saved_profile(resumed, {**key, "seed": 1}) is None and _saved_profile(str(tmp_path), key) is None
    real, calls = optmod.profile_step, []
    monkeypatch.setattr(optmod, "profile_step", lambda *a, **kw: calls.append(kw.get("trace_path")) or real(*a, **kw))
    real_finalize, finalized = optmod.Search.finalize, []
    monkeypatch.setattr(optmod.Search, "finalize", lambda self, r, **kw: finalized.append(1) or real_finalize(self, r, **kw))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    first = optimize(opts)
    locked_trace = os.path.join(resumed, "locked_profile.trace.json")
    assert calls == [locked_trace]  # the locked build's profile only
    assert finalized == []  # and the end-to-end builds' timings and gate from end_to_end.json
    assert first["locked_ms"] == run[1]["locked_ms"] and first["reference_ms"] == run[1]["reference_ms"]
    optimize(OptimizeOptions(**{**opts.__dict__, "seed": 1}))
    assert calls[1:] == [os.path.join(resumed, "profile.trace.json"), locked_trace] and finalized == [1]


def test_a_relock_reports_what_changed_against_the_lock_it_replaced(run, tmp_path, monkeypatch):
    """A re-lock in a run folder compares itself with the report it replaces: the locked step then
    and now, and each point whose locked variant or config changed; a rerun that locks the same
    build again keeps that comparison."""
    import shutil

    resumed = str(tmp_path / "resumed")
    shutil.copytree(run[0], resumed)
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
    opts = OptimizeOptions(target="decode-b1", preset="beam-tiny", dtype=torch.float32, device=torch.device("cpu"),
                           out_dir=resumed, points=POINTS_SEARCHED, command="pytest")
    previous = optimize(opts)["previous"]
    assert previous["locked_ms"] == 99.0
    assert [c["point"] for c in previous["changed"]] == ["boundary"]
    assert previous["changed"][0]["was"] == 'planted {"num_warps":2}' and previous["changed"][0]["was_ms"] == 1.5
    assert previous["changed"][0]["now"].startswith(was["variant"])
    with open(os.path.join(resumed, "report.md")) as f:
        assert "## Against the lock this one replaced" in f.read()
    assert optimize(opts)["previous"] == previous  # the same lock again


def test_a_run_ended_in_the_end_to_end_stage_resumes_its_builds(run, tmp_path, monkeypatch):
    """optimize keeps each end-to-end build in end_to_end.json as it is made: a run that a command's
    limit ends there (here, once the model gate and the reference build are saved) keeps both, and the
    same command then makes neither again and writes the lock."""
    import shutil

    from workbench import gates
    from workbench import optimize as optmod

    resumed = str(tmp_path / "resumed")
    shutil.copytree(run[0], resumed)
    os.remove(os.path.join(resumed, "end_to_end.json"))
    real_write, real_time, real_gate = optmod._write_json, optmod.Search.time_build, gates.model_gate
    timed, gated, ended = [], [], []

    def write(path, obj):
        real_write(path, obj)
        if len(obj.get("journal", ())) == 2 and not ended:
            ended.append(1)
            raise TimeoutError("the command's time limit")

    monkeypatch.setattr(optmod, "_write_json", write)

    def time_build(self, selection, configs=None, **kw):
        # builds timed alone: a paired timing's rounds (their own budget, one journal entry) time the
        # reference build again when every choice is within the noise
        if "budget_s" not in kw:
            timed.append(dict(selection))
        return real_time(self, selection, configs, **kw)

    monkeypatch.setattr(optmod.Search, "time_build", time_build)
    monkeypatch.setattr(gates, "model_gate", lambda model, selection, **kw: gated.append(dict(selection)) or
                        real_gate(model, selection, **kw))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(bench, "PROCESS_ID", "first-command")
    opts = OptimizeOptions(target="decode-b1", preset="beam-tiny", dtype=torch.float32, device=torch.device("cpu"),
                           out_dir=resumed, points=POINTS_SEARCHED, command="pytest")
    with pytest.raises(TimeoutError):
        optimize(opts)
    assert timed == [{}] and len(gated) == 1  # the chosen set's model gate, then the reference build
    events = []
    monkeypatch.setattr(bench, "PROCESS_ID", "second-command")
    report = optimize(opts, on_event=events.append)
    assert {"type": "resumed_end_to_end", "builds": 2} in events
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


def test_a_report_from_before_configs_were_recorded_compares_variants_only():
    from workbench.optimize import against_previous

    step = {"target": "decode-b1", "preset": "p", "dtype": "bf16", "gpu": "g"}
    old = {**step, "locked_ms": 3.6, "points": [{"point": "experts", "variant": "triton", "ms": 1.6},
                                                {"point": "head", "variant": "torch", "ms": 0.07}]}
    new = {**step, "locked_ms": 3.5, "points": [{"point": "experts", "variant": "triton", "config": {"BLOCK_N": 8},
                                                 "ms": 1.5},
                                                {"point": "head", "variant": "triton", "config": None, "ms": 0.05}]}
    assert [c["point"] for c in against_previous(old, new)["changed"]] == ["head"]
    assert against_previous({**old, "gpu": "other"}, new) is None  # another GPU's lock: no comparison


def test_the_report_says_when_no_points_choice_changed_instead_of_an_empty_table():
    from workbench.optimize import _against_previous_lines

    same = {"locked_ms": 3.0, "git_commit": "abc", "changed": []}
    text = "\n".join(_against_previous_lines(same, 2.9))
    assert "3.000 ms then (commit abc), 2.900 ms now. No point's locked variant or config changed." in text
    assert "| point |" not in text
    moved = {**same, "changed": [{"point": "head", "was": "torch", "was_ms": 0.07, "now": "triton", "now_ms": 0.05}]}
    assert "| head | torch | 0.070 | triton | 0.050 |" in "\n".join(_against_previous_lines(moved, 2.9))


def test_every_compile_baseline_is_a_report_row_and_is_kept_for_a_resumed_run(run, tmp_path, monkeypatch):
    """`--compile-baseline points max-autotune-no-cudagraphs`: one row each in the report (the issue's
    baseline beside every point's torch_compile); each is saved to end_to_end.json once timed, so a
    resumed run times none again (a whole-step max-autotune compile takes minutes), and the whole-step
    one is kept for later re-locks of the folder."""
    import shutil

    from workbench import optimize as optmod

    resumed = str(tmp_path / "resumed")
    shutil.copytree(run[0], resumed)  # its end_to_end.json holds the "points" baseline
    timed = []
    monkeypatch.setattr(optmod, "time_compile_baseline", lambda search, mode, results: timed.append(mode) or
                        (None, {}, f"torch.compile ({mode}) of the whole step failed: planted"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    opts = OptimizeOptions(target="decode-b1", preset="beam-tiny", dtype=torch.float32, device=torch.device("cpu"),
                           out_dir=resumed, points=POINTS_SEARCHED, command="pytest",
                           compile_baselines=("points", "max-autotune-no-cudagraphs"))
    report = optimize(opts)
    assert timed == ["max-autotune-no-cudagraphs"]
    assert [b["mode"] for b in report["torch_compile_baselines"]] == ["points", "max-autotune-no-cudagraphs"]
    assert report["torch_compile_ms"] == run[1]["torch_compile_ms"]  # the first row fills the old fields
    with open(os.path.join(resumed, "report.md")) as f:
        md = f.read()
    assert "| torch.compile (every point) |" in md
    assert "| torch.compile of the whole reference step (max-autotune-no-cudagraphs) | failed | |" in md
    assert "torch.compile (max-autotune-no-cudagraphs) of the whole step failed: planted" in md
    optimize(opts)
    assert timed == ["max-autotune-no-cudagraphs"]
    # A re-lock after a kernel change (here: end_to_end.json gone) times every point's build again,
    # and reuses the whole reference step's compile, which did not change.
    os.remove(os.path.join(resumed, "end_to_end.json"))
    optimize(opts)
    assert timed == ["max-autotune-no-cudagraphs", "points"]


def test_whole_step_baselines_are_made_before_the_search(tmp_path, monkeypatch):
    """A whole-step baseline compiles the reference step only: a run stopped before its first point
    (`--budget 0`, a GPU host whose kernel libraries have not all arrived) leaves it made and kept."""
    from workbench import optimize as optmod

    timed = []
    monkeypatch.setattr(optmod, "time_compile_baseline", lambda search, mode, results: timed.append(mode) or
                        (1234.0, {}, None))
    out = str(tmp_path / "stopped")
    opts = OptimizeOptions(target="decode-b1", preset="beam-tiny", dtype=torch.float32, device=torch.device("cpu"),
                           out_dir=out, points=POINTS_SEARCHED, budget_s=0.0,
                           compile_baselines=("points", "max-autotune-no-cudagraphs"))
    assert optimize(opts)["stopped"] and timed == ["max-autotune-no-cudagraphs"]
    assert not os.path.exists(os.path.join(out, "search"))
    with open(os.path.join(out, "compile_baselines.json")) as f:
        assert f.read().count("1234.0") == 1


def test_a_choice_failing_the_model_gate_is_dropped_not_locked(tmp_path):
    """The op gate sees the target's decode shapes only; a kernel with no prefill path passes it,
    then fails the model gate's ragged prefill: finalize drops that choice and keeps the others."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from planted import planted

    from workbench import registry
    from workbench.search import Search

    runner = _tiny_runner()
    events = []
    search = Search(runner, calls={}, out_dir=str(tmp_path), on_event=events.append)
    table = registry.variants("attention")
    table["planted_decode_only"] = planted("decode_only")
    try:
        chosen, configs = {"attention": "planted_decode_only", "qkvg_proj": "packed"}, {}
        search._drop_model_gate_failures(chosen, configs)
    finally:
        del table["planted_decode_only"]
    assert chosen == {"qkvg_proj": "packed"}
    assert [(e["point"], e["variant"]) for e in events if e["type"] == "model_gate_dropped"] == \
        [("attention", "planted_decode_only")]


def test_a_torch_compile_entry_pins_the_code_it_compiles():
    """The compiled variant's function lives in the registry; its lock entry must still change
    when the point's reference module does."""
    from workbench.registry import get

    assert get("attention", "torch_compile").source_file == get("attention", "torch").source_file
    assert lockmod.source_hash("attention", "torch_compile") != lockmod.source_hash("boundary", "torch_compile")


def test_backends_filter_leaves_candidates_out_and_keys_the_cache(tmp_path):
    from workbench.registry import get, variants
    from workbench.search import PointResult, Search

    runner = _tiny_runner()
    calls = {"qkvg_proj": {"sliding": 5, "full": 2}}
    only = Search(runner, calls=calls, out_dir=str(tmp_path), backends=("torch_compile",))
    every = Search(runner, calls=calls, out_dir=str(tmp_path))
    workloads = only.workloads("qkvg_proj")
    assert "left out" in only._unavailable(get("qkvg_proj", "packed"), workloads)
    assert only._unavailable(get("qkvg_proj", "torch_compile"), workloads) is None
    assert every._unavailable(get("qkvg_proj", "packed"), workloads) is None
    assert only._fingerprint("qkvg_proj") != every._fingerprint("qkvg_proj")  # no reuse across filters
    again = Search(runner, calls=calls, out_dir=str(tmp_path), backends=("torch_compile",))
    saved = PointResult("qkvg_proj", "torch_compile", None, 10.0, 8.0, 0.02, [])
    only._save("qkvg_proj", saved)  # a filtered run resumes from its own cache (JSON lists vs tuples)
    assert again._load("qkvg_proj") == saved and every._load("qkvg_proj") is None
    backends = {v.backend for v in variants("qkvg_proj").values()}
    untouched = Search(runner, calls=calls, out_dir=str(tmp_path), backends=tuple(backends | {"cute"}))
    assert untouched._fingerprint("qkvg_proj") == every._fingerprint("qkvg_proj")  # filters nothing here


@pytest.mark.parametrize("named, says", [(["torch", "flashinfer"], "'flashinfer' package, which is not installed"),
                                         (["torch", "trition"], "unknown backend 'trition'")])
def test_optimize_refuses_backends_it_cannot_search(tmp_path, monkeypatch, capsys, named, says):
    """Asked for a backend that cannot run here, optimize stops before it writes anything, naming it;
    it does not search and lock a build without it."""
    from workbench import cli, registry

    def available(b):  # flashinfer missing, wherever the test runs
        return (False, f"backend {b!r} needs the 'flashinfer' package, which is not installed") \
            if b == "flashinfer" else registry.backend_available(b)
    monkeypatch.setattr("workbench.optimize.backend_available", available)
    out = tmp_path / "run"
    assert cli.main(["optimize", "--preset", "beam-tiny", "--device", "cpu", "--out", str(out),
                     "--backends", *named]) == 2
    assert says in " ".join(capsys.readouterr().err.split()) and not out.exists()


def _lock_boundary_at(out, variant):
    """Plant a lock choice (written as optimize writes it: its digest matches)."""
    path = os.path.join(out, "lock.yaml")
    planted, _ = Lock.load(path)
    planted.points["boundary"] = Lock.entry("boundary", variant)
    planted.save(path)


@pytest.mark.parametrize("locked, options, says", [
    ("cute", {}, "boundary:cute (backend 'cute' needs"),
    ("torch_compile", {"backends": ("torch",)}, "boundary:torch_compile (backend 'torch_compile' left out of --backends)"),
    ("torch_compile", {"points": ("qkvg_proj",)}, "boundary:torch_compile (boundary is not among --points)"),
    (None, {}, "is not valid YAML"),
])
def test_a_relock_that_cannot_search_the_locks_choices_stops_before_writing(run, tmp_path, monkeypatch, locked,
                                                                           options, says):
    """A run in a folder holding a lock refuses, naming the choice, when it could not search one of
    that lock's choices (a backend missing here: a re-lock once wrote a far slower decode lock on a
    host without FlashInfer), and writes nothing; --force writes over it."""
    out = str(tmp_path / "relock")
    shutil.copytree(run[0], out)
    path = os.path.join(out, "lock.yaml")
    if locked:
        _lock_boundary_at(out, locked)
    else:
        with open(path, "a") as f:
            f.write("points: [\n")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    before = {name: os.path.getmtime(os.path.join(out, name)) for name in os.listdir(out)}
    with open(path) as f:
        kept = f.read()
    opts = OptimizeOptions(target="decode-b1", preset="beam-tiny", dtype=torch.float32, device=torch.device("cpu"),
                           out_dir=out, command="pytest", **{"points": POINTS_SEARCHED, **options})
    with pytest.raises(ValueError) as e:
        optimize(opts)
    assert says in str(e.value) and "--force" in str(e.value)
    assert {name: os.path.getmtime(os.path.join(out, name)) for name in os.listdir(out)} == before
    with open(path) as f:
        assert f.read() == kept
    if options.get("points") is None and locked != "cute":  # forced, the run resumes and locks its own choice
        opts.force = True
        report = optimize(opts)
        assert Lock.load(path)[0].selection["boundary"] == next(p["variant"] for p in report["points"]
                                                                if p["point"] == "boundary")


def test_the_optimize_command_names_the_lock_choice_it_cannot_search(run, tmp_path, monkeypatch, capsys):
    from workbench import cli

    out = str(tmp_path / "relock")
    shutil.copytree(run[0], out)
    _lock_boundary_at(out, "cute")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = ["optimize", "--preset", "beam-tiny", "--device", "cpu", "--out", out, "--points", *POINTS_SEARCHED]
    assert cli.main(args) == 2
    assert "boundary:cute" in " ".join(capsys.readouterr().err.split())
    assert cli.main([*args, "--force"]) == 0  # the search resumes from the folder and locks its own choice
    assert Lock.load(os.path.join(out, "lock.yaml"))[0].selection["boundary"] != "cute"


class _ProcessDied(BaseException):
    """Stands in for the end of a process: escapes the gates' `except Exception`, as os._exit would."""


def test_code_key_leaves_out_config_lists_but_not_code_or_the_variants_own_configs(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from workbench import lock

    module = tmp_path / "point.py"
    own = SimpleNamespace(configs=[{"BLOCK": 64}])
    monkeypatch.setattr(lock, "_source_paths", lambda point, variant: [str(module)])
    monkeypatch.setattr(lock, "get", lambda point, variant: own)

    def key(source):
        module.write_text(source)
        return lock.code_key("p", "v")

    base = key("TRITON_CONFIGS = [dict(BLOCK=64)]\n\ndef f(x):\n    return x + 1\n")
    assert key("TRITON_CONFIGS = [dict(BLOCK=64), dict(BLOCK=128)]  # more\n\ndef f(x):\n    return x + 1\n") == base
    assert key("TRITON_CONFIGS = [dict(BLOCK=64)]\n\ndef f(x):\n    return x + 2\n") != base
    assert key("LIMIT = 3\nTRITON_CONFIGS = [dict(BLOCK=64)]\n\ndef f(x):\n    return x + 1\n") != base
    own.configs = [{"BLOCK": 128}]
    assert key("TRITON_CONFIGS = [dict(BLOCK=64)]\n\ndef f(x):\n    return x + 1\n") != base


def test_code_key_matches_the_legacy_form_and_code_text_keeps_only_code(tmp_path, monkeypatch):
    """Keys stored before the token form (`ast.dump`, Python-version dependent) still match; the token
    text ignores comments, blank lines, layout and config lists, and keeps f-strings whole."""
    from types import SimpleNamespace

    from workbench import lock
    from workbench.code_text import code_text

    module = tmp_path / "point.py"
    module.write_text("X_CONFIGS = [1]\n\ndef f(x):\n    return f'{x + 1:>4}' + 'a'\n")
    monkeypatch.setattr(lock, "_source_paths", lambda point, variant: [str(module)])
    monkeypatch.setattr(lock, "get", lambda point, variant: SimpleNamespace(configs=[]))
    assert lock.code_key("p", "v", legacy=True) != lock.code_key("p", "v")
    for stored in (lock.code_key("p", "v", legacy=True), lock.code_key("p", "v")):
        assert lock.code_key_matches(stored, "p", "v")
    assert not lock.code_key_matches("0" * 16, "p", "v") and not lock.code_key_matches(None, "p", "v")

    base = code_text(module.read_text())
    assert base.splitlines() == ["def", "f", "(", "x", ")", ":", "NEWLINE", "INDENT", "return", "f'{x + 1:>4}'",
                                 "+", "'a'", "NEWLINE", "DEDENT", "ENDMARKER"]
    assert code_text("# note\nX_CONFIGS = [1,\n    2]\n\n\ndef f(x):  # why\n    return f'{x + 1:>4}' + 'a'\n") == base
    assert code_text("def f(x):\n    return f'{x + 2:>4}' + 'a'\n") != base


@pytest.mark.skipif(not os.path.isdir("/proc") or not shutil.which("sleep"), reason="needs Linux /proc and sleep")
def test_a_candidate_s_first_use_build_is_not_held_against_its_limit(tmp_path):
    """A candidate whose first call runs a compiler (here a copy of sleep named nvcc, as FlashInfer's JIT
    runs nvcc) longer than the candidate limit is gated and timed, not ended; the build's time is in
    its result (`compile_s`), apart from the rest."""
    import subprocess

    from workbench import registry
    from workbench.search import Search

    nvcc = tmp_path / "nvcc"
    shutil.copy(shutil.which("sleep"), nvcc)
    reference, built = registry.reference("boundary").fn, []

    def builds_first(*args, **kwargs):
        if not built:
            subprocess.run([str(nvcc), "1.2"], check=True)
            built.append(1)
        return reference(*args, **kwargs)

    stalls = []
    table = registry.variants("boundary")
    table["planted_jit"] = registry.Variant("boundary", "planted_jit", "torch", builds_first)
    try:
        search = Search(_tiny_runner(), calls={"boundary": {"sliding": 2, "full": 2}}, out_dir=str(tmp_path),
                        backends=("torch",), candidate_timeout=0.5, on_stall=stalls.append)
        row = search.search_point("boundary").candidate("planted_jit", None)
    finally:
        del table["planted_jit"]
    assert not stalls and row.gate_passed and row.step_us
    assert 0.8 < row.compile_s < row.seconds
    from dataclasses import asdict

    from rich.console import Console

    from workbench.progress import ConsoleProgress

    console = Console(record=True, width=200)
    ConsoleProgress(console).event({"type": "candidate", "result": asdict(row)})
    assert f"({row.seconds:.1f} s, {row.compile_s:.1f} s of it compiling)" in console.export_text()


def test_a_hung_candidate_costs_one_run_and_is_skipped_when_resumed(tmp_path):
    """The watchdog fires on a candidate that never returns; the candidate stays recorded as in flight,
    so the resumed search skips it with the reason, searches the rest and clears the record."""
    import threading

    from workbench import registry
    from workbench.search import Search

    released, calls_made = threading.Event(), []

    def hangs(*args, **kwargs):
        calls_made.append(1)
        released.wait(60)  # "hung" until the watchdog's stand-in releases it
        raise _ProcessDied

    runner = _tiny_runner()
    calls = {"boundary": {"sliding": 2, "full": 2}}
    stalls = []

    def on_stall(candidate):
        stalls.append(candidate)
        released.set()

    table = registry.variants("boundary")
    table["planted_hang"] = registry.Variant("boundary", "planted_hang", "torch", hangs,
                                             configs=[{"unroll": 1}, {"unroll": 2}],
                                             configure=lambda cfg: hangs)
    try:
        first = Search(runner, calls=calls, out_dir=str(tmp_path), backends=("torch",), candidate_timeout=0.5,
                       on_stall=on_stall)
        with pytest.raises(_ProcessDied):
            first.search_point("boundary")
        assert [(c["variant"], c["config"], c["timeout_s"]) for c in stalls] == [("planted_hang", {"unroll": 1}, 0.5)]
        inflight = tmp_path / "search" / "boundary.inflight"
        assert [c["variant"] for c in json.loads(inflight.read_text())["candidates"]] == ["planted_hang"]
        assert not (tmp_path / "search" / "boundary.json").exists()

        n = len(calls_made)
        resumed = Search(runner, calls=calls, out_dir=str(tmp_path), backends=("torch",))
        result = resumed.search_point("boundary")
        assert len(calls_made) == n  # never called again
        rows = [c for c in result.candidates if c.variant == "planted_hang"]
        assert [r.config for r in rows] == [{"unroll": 1}, {"unroll": 2}]  # neither config is tried
        assert all("did not finish in an earlier run" in r.skipped and "boundary.inflight" in r.skipped
                   and "{'unroll': 1}" in r.skipped for r in rows)
        assert result.choice == "torch" and not inflight.exists()
        assert (tmp_path / "search" / "boundary.json").exists()

        # A variant added to the point makes its cache stale: the point is searched again, and the
        # hung variant, whose code did not change, is skipped again rather than hung on again.
        table["planted_new"] = registry.Variant("boundary", "planted_new", "torch", registry.reference("boundary").fn)
        again = Search(runner, calls=calls, out_dir=str(tmp_path), backends=("torch",)).search_point("boundary")
        assert len(calls_made) == n and "planted_new" in [c.variant for c in again.candidates]
        rows = [c for c in again.candidates if c.variant == "planted_hang"]
        assert rows and all("did not finish in an earlier run" in r.skipped and "its code is unchanged" in r.skipped
                            for r in rows)
        # Its code changed (here: the saved record says it was other code): it is tried again.
        fresh = Search(runner, calls=calls, out_dir=str(tmp_path), backends=("torch",))
        fingerprint = fresh._fingerprint("boundary")
        cache = tmp_path / "search" / "boundary.json"
        saved = json.loads(cache.read_text())
        assert set(fresh._stalled_before("boundary", fingerprint)) == {"planted_hang"}
        other_source = {**saved["fingerprint"], "sources": {**saved["fingerprint"]["sources"], "planted_hang": "x"}}
        # its module changed outside its code and configs (another variant's config list): still skipped
        cache.write_text(json.dumps({**saved, "fingerprint": other_source}))
        assert set(fresh._stalled_before("boundary", fingerprint)) == {"planted_hang"}
        cache.write_text(json.dumps({**saved, "fingerprint": other_source,
                                     "code_keys": {**saved["code_keys"], "planted_hang": "other code"}}))
        assert fresh._stalled_before("boundary", fingerprint) == {}
        cache.write_text(json.dumps({**{k: v for k, v in saved.items() if k != "code_keys"},
                                     "fingerprint": other_source}))  # saved before code keys existed
        assert fresh._stalled_before("boundary", fingerprint) == {}
        cache.write_text(json.dumps({**saved, "fingerprint": {**saved["fingerprint"], "calls": {"sliding": 9}}}))
        assert fresh._stalled_before("boundary", fingerprint) == {}  # other shapes: nothing carried over
        cache.write_text(json.dumps({**saved, "fingerprint": {**saved["fingerprint"], "workloads": {"all": "other"}}}))
        assert fresh._stalled_before("boundary", fingerprint) == {}
    finally:
        table.pop("planted_new", None)
        del table["planted_hang"]
        released.set()


def test_a_candidate_stopped_from_outside_is_tried_again_once(tmp_path):
    """Ctrl-C, or a command's time limit (SIGTERM, which the CLI turns into the same), stopping a run
    in a candidate (a FlashInfer JIT build cut off at prefill, session 30) is not the candidate's hang:
    the next run tries it again; one stopped in STOPS_TRIED runs is then skipped like a hung one."""
    from workbench import registry
    from workbench.search import STALLED, STOPS_TRIED, Search

    stop, calls_made = [True], []
    reference = registry.reference("boundary").fn

    def stopped_in(*args, **kwargs):
        calls_made.append(1)
        if stop[0]:
            raise KeyboardInterrupt
        return reference(*args, **kwargs)

    runner = _tiny_runner()
    calls = {"boundary": {"sliding": 2, "full": 2}}
    table = registry.variants("boundary")
    table["planted_stop"] = registry.Variant("boundary", "planted_stop", "torch", stopped_in)
    inflight = tmp_path / "search" / "boundary.inflight"

    def search():
        return Search(runner, calls=calls, out_dir=str(tmp_path), backends=("torch",)).search_point("boundary")
    try:
        for n in range(1, STOPS_TRIED + 1):  # stopped in it run after run: each run tries it again
            with pytest.raises(KeyboardInterrupt):
                search()
            assert [(c["variant"], c["stopped"]) for c in json.loads(inflight.read_text())["candidates"]] == \
                [("planted_stop", n)]
        tried = len(calls_made)
        stop[0] = False
        row = next(c for c in search().candidates if c.variant == "planted_stop")
        assert len(calls_made) == tried and STALLED in row.skipped  # stopped too often: skipped
        (tmp_path / "search" / "boundary.json").unlink()
        inflight.write_text(json.dumps({"fingerprint": json.loads(json.dumps(Search(
            runner, calls=calls, out_dir=str(tmp_path), backends=("torch",))._fingerprint("boundary"))),
            "candidates": [{"point": "boundary", "variant": "planted_stop", "config": None, "stopped": 1}]}))
        row = next(c for c in search().candidates if c.variant == "planted_stop")
        assert len(calls_made) > tried and row.skipped is None and row.gate_passed and not inflight.exists()
    finally:
        del table["planted_stop"]


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


def test_profile_refuses_a_lock_that_fails_verification(run, tmp_path, capsys):
    from workbench.cli import main

    out, _, _ = run
    path = _tampered(out, tmp_path, lambda raw: raw["end_to_end"].update(locked_us=0.001))
    args = ["profile", "--lock", path, "--device", "cpu", "--out", str(tmp_path / "prof")]
    assert main(args) == 2
    err = " ".join(capsys.readouterr().err.split())  # the console wraps long lines
    assert "failed verification" in err and "digest" in err and "--force-lock" in err
    assert not (tmp_path / "prof" / "profile.json").exists()


def test_serve_names_the_shapes_a_lock_was_not_searched_at():
    from types import SimpleNamespace

    from workbench.commands.serve import lock_warnings

    def lock(target, **selection):
        return SimpleNamespace(target=target, selection=selection)

    assert lock_warnings(lock("decode-b8", boundary="triton"), max_num_seqs=8) == []
    (line,) = lock_warnings(lock("decode-b1"), max_num_seqs=32)
    assert "decode-b1 (batch 1)" in line and "up to 32" in line
    (line,) = lock_warnings(lock("prefill-8x2k"), max_num_seqs=4)
    assert "prefill-8x2k" in line and "decode steps" in line
    compiled, batch = lock_warnings(lock("decode-b1", attention="torch_compile"), max_num_seqs=8)
    assert "torch_compile for attention" in compiled and "batch 1" in batch
    assert "unknown target" in lock_warnings(lock("decode-b3"), max_num_seqs=1)[0]


def test_torch_compile_build_leaves_out_a_point_whose_compile_stalled_in_the_search():
    from workbench.optimize import report_markdown, uncompilable
    from workbench.search import CandidateResult, PointResult

    stalled = CandidateResult("experts", "torch_compile", "torch_compile", None, False,
                              skipped="torch_compile did not finish in an earlier run of this search")
    timed = CandidateResult("route", "torch_compile", "torch_compile", None, True, step_us=5.0)
    results = {"experts": PointResult("experts", "torch", None, 9.0, 9.0, 0.02, [stalled]),
               "route": PointResult("route", "torch_compile", None, 9.0, 5.0, 0.02, [timed])}
    assert uncompilable(results) == {"experts": stalled.skipped}
    line = "The torch.compile build keeps the reference at experts: " + stalled.skipped
    report = {"target": "t", "preset": "p", "dtype": "bf16", "command": "c", "gpu": None, "environment": {},
              "reference_ms": 2.0, "locked_ms": 1.0, "torch_compile_ms": 1.5, "speedup": 2.0,
              "speedup_vs_torch_compile": 1.5, "floor_ms": 0.5, "fraction_of_floor": 0.5,
              "kernels_per_layer": {"reference": {}, "locked": {}}, "points": [],
              "torch_compile_left_out": uncompilable(results)}
    assert line in report_markdown(report).splitlines()


def test_console_summary_names_builds_timed_in_another_process():
    from rich.console import Console

    from workbench.progress import ConsoleProgress

    report = {"target": "t", "preset": "p", "dtype": "bf16", "gpu": None, "reference_ms": 2.0, "locked_ms": 1.0,
              "speedup": 2.0, "torch_compile_ms": 1.5, "speedup_vs_torch_compile": 1.5, "points": []}
    for apart, shown in ((["reference"], True), ([], False), (None, False)):
        console = Console(record=True, width=200)
        ConsoleProgress(console).summary({**report, "timed_apart": apart}, "out")
        text = console.export_text()
        assert ("timed in a process other than the locked build's (ratios to it pair two processes): reference"
                in text) == shown, apart
    console = Console(record=True, width=200)
    progress = ConsoleProgress(console)
    progress.event({"type": "dropped_as_noise", "choices": {"head": "triton"}, "band": 0.01, "before_us": 990.0,
                    "after_us": 1000.0})
    progress.event({"type": "paired", "choices": {"head": "triton"}, "gain": 0.001, "band": 0.005,
                    "rounds": [[990.0, 991.0]] * 10, "kept": False})
    progress.summary({**report, "dropped": {"head": "triton"}, "step_band": 0.01, "before_drop_ms": 0.99}, "out")
    text = console.export_text()
    assert "dropped as noise (each reverted within 1.0%): head:triton; step 990.0 us with them, 1000.0 us without" \
        in text
    assert "each reverted within the noise: head:triton; without them the step is 0.10% slower in 10 paired " \
        "rounds (band 0.50%): to be dropped" in text
    progress.event({"type": "challenger", "point": "experts", "variant": "triton_rows", "config": {"pdl": True},
                    "gain": 0.05, "band": 0.005, "rounds": [[1.0, 1.05]] * 10, "won": True})
    assert "experts: triton_rows {'pdl': True} tied at the op level, tried end to end: with the choice the step " \
        "is 5.00% slower in 10 paired rounds (band 0.50%): taken" in console.export_text()
    assert "Dropped at the end-to-end stage, each reverted within the step's noise band (1.0%): head:triton; the " \
        "chosen set with them timed 0.990 ms, the locked set without them 1.000 ms." in text


def test_whole_step_compile_baseline_runs_the_step_through_torch_compile(monkeypatch):
    """`--compile-baseline MODE`: the whole reference step through torch.compile (a user's baseline);
    the compiler is swapped for Dynamo's eager backend here (the plumbing, not Inductor, is tested)."""

    asked, real = [], torch.compile

    def compile_eagerly(fn, *, mode=None, dynamic=None):
        asked.append((mode, dynamic))
        return real(fn, backend="eager", dynamic=dynamic)

    monkeypatch.setattr(torch, "compile", compile_eagerly)
    runner = _tiny_runner()
    eager = runner().clone()
    runner.rebind({}, compile_mode="max-autotune-no-cudagraphs")
    assert torch.equal(runner(), eager) and asked == [("max-autotune-no-cudagraphs", False)]
    runner.rebind({})  # back to eager, op by op
    assert torch.equal(runner(), eager) and len(asked) == 1


def test_report_names_the_compile_baseline():
    from workbench.optimize import report_markdown

    report = {"target": "t", "preset": "p", "dtype": "bf16", "command": "c", "gpu": None, "environment": {},
              "reference_ms": 2.0, "locked_ms": 1.0, "torch_compile_ms": 1.5, "speedup": 2.0,
              "speedup_vs_torch_compile": 1.5, "floor_ms": 0.5, "fraction_of_floor": 0.5,
              "kernels_per_layer": {"reference": {}, "locked": {}}, "points": []}
    assert "| torch.compile (every point) | 1.500 | 1.50x |" in report_markdown(report)  # older reports
    report["torch_compile_baseline"] = "max-autotune-no-cudagraphs"
    assert "| torch.compile of the whole reference step (max-autotune-no-cudagraphs) | 1.500 |" \
        in report_markdown(report)


def test_members_of_a_locked_fused_compound_are_reported_as_run_by_it():
    """With attention_out locked at a fused variant, attention's and attn_out's own selections never run
    (the end-to-end stage leaves them at the reference): the report says what runs in their place, not
    that the locked build runs the reference attention."""
    from workbench.optimize import mark_run_by_compounds, report_markdown

    def point(name, variant):
        return {"point": name, "variant": variant, "backend": variant, "ms": 1.0, "reference_ms": 3.0,
                "reverted_ms": 2.0}
    report = {"target": "t", "preset": "p", "dtype": "bf16", "command": "c", "gpu": None, "environment": {},
              "reference_ms": 2.0, "locked_ms": 1.0, "torch_compile_ms": 1.5, "speedup": 2.0,
              "speedup_vs_torch_compile": 1.5, "floor_ms": 0.5, "fraction_of_floor": 0.5,
              "kernels_per_layer": {"reference": {}, "locked": {}}, "dropped": {"attention": "triton", "head": "triton"},
              "points": [point("attention", "torch"), point("attn_out", "torch"), point("head", "torch"),
                         point("attention_out", "torch")],
              "previous": {"locked_ms": 1.1, "git_commit": "abc",
                           "changed": [{"point": "attention", "was": "triton", "was_ms": 0.3, "now": "torch",
                                        "now_ms": 3.0}]}}
    mark_run_by_compounds(report)  # the compound at its reference: the members' selections run
    assert not any("run_by" in p for p in report["points"])
    assert "| attention | torch | torch | 1.000 |" in report_markdown(report)
    report["points"][3]["variant"] = "triton"
    mark_run_by_compounds(report)
    assert [p.get("run_by") for p in report["points"]] == ["attention_out:triton"] * 2 + [None, None]
    md = report_markdown(report)
    assert "| attention | run by attention_out:triton | - | - | 3.000 | - | - | - |" in md
    assert "| attn_out | run by attention_out:triton |" in md and "| head | torch | torch | 1.000 |" in md
    assert "noise band: attention:triton (attention_out:triton runs in its place), head:triton." in md
    assert "| attention | triton | 0.300 | run by attention_out:triton | - |" in md


def test_a_point_blind_to_the_layer_kind_is_timed_once_for_all_its_calls():
    from workbench.search import ALL_LAYERS, Search

    runner = _tiny_runner()
    calls = {"experts": {"sliding": 3, "full": 2}, "attention": {"sliding": 5, "full": 2}, "head": {"sliding": 1}}
    search = Search(runner, calls=calls, out_dir="unused")
    assert search.step_calls("experts") == {ALL_LAYERS: 5} and list(search.workloads("experts")) == [ALL_LAYERS]
    assert search.step_calls("attention") == calls["attention"]  # window, cache group: per kind
    assert {k: w.layer for k, w in search.workloads("attention").items()} == {"sliding": "sliding", "full": "full"}
    assert search.step_calls("head") == {"sliding": 1}


def test_a_compiled_point_is_timed_by_the_cpu_profiler():
    """On the CPU the profiler counts the ATen ops under a point's range; torch.compile's generated
    kernels have none, so a compiled point read ~0 us in the locked step's profile. Its compiled
    graph's own time is counted now."""
    from workbench.profiler.attribution import profile_step

    runner = _tiny_runner()
    runner.rebind({"boundary": "torch_compile"})
    boundary = next(p for p in profile_step(runner).points if p.point == "boundary")
    assert boundary.variant == "torch_compile" and boundary.time_us > 0
    assert boundary.kernels >= boundary.calls  # at least one compiled graph's kernels per call


def test_the_profiled_step_runs_as_the_timed_one_in_inference_mode():
    """The prefill lock's profile raised "Inplace update to inference tensor outside InferenceMode"
    after the timed builds (runs/optimize-prefill-8x2k-beam-501b-tp8/logs/13-*.log, 15-*.log): a
    variant's workspace made in a timed (inference-mode) step, written again by a profiled step run
    outside it. FlashInfer's prefill wrapper keeps such a buffer; a planted variant keeps one here."""
    from workbench import registry
    from workbench.profiler.attribution import profile_step
    from workbench.registry import Variant

    reference, workspace = registry.get("boundary", "torch").fn, []

    def keeps_a_workspace(*args, **kw):
        if not workspace:
            workspace.append(torch.zeros(1))  # made on the first call: in inference mode when timed
        workspace[0].add_(1)
        return reference(*args, **kw)

    table = registry.variants("boundary")
    table["keeps_workspace"] = Variant("boundary", "keeps_workspace", "torch", keeps_a_workspace)
    try:
        runner = _tiny_runner()
        runner.rebind({"boundary": "keeps_workspace"})
        runner()  # as a timed step runs
        assert workspace[0].is_inference()
        profile_step(runner)
    finally:
        del table["keeps_workspace"]
    assert workspace[0].item() >= 3


def test_head_and_sample_are_timed_on_each_prompts_last_token():
    """A prefill step runs head and sample on each sequence's last new token (the profiler's "model"
    calls): the search once timed them at one row per prompt token, 16384 rows at prefill-8x2k
    (runs/optimize-prefill-8x2k-beam-501b-tp8/README.md), a workload the step never runs."""
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


def test_a_point_whose_compile_fails_end_to_end_is_kept_at_its_reference(monkeypatch):
    """A compile that passed the search can still fail in the end-to-end build (the prefill run's
    `sample`: an Inductor codegen error): that point joins those kept at their reference, the build is
    timed again from a clean compiler state, and the report says why; a build that fails otherwise (a
    whole-step compile, an error no point's compile raised: the prefill run's second attempt) costs the
    report its row, not the lock."""
    from workbench.optimize import report_markdown, time_compile_baseline
    from workbench.registry import _compiled, get

    def broken(*a, **kw):
        raise TypeError("list indices must be integers or slices, not NoneType")

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: broken)
    compiled_sample = _compiled(get("sample", "torch").fn)  # as the build's sample:torch_compile

    class Builds:
        def __init__(self):
            self.timed = []

        def time_build(self, selection, configs=None, *, compile_mode=None):
            self.timed.append(compile_mode or sorted(selection))
            if compile_mode:
                raise RuntimeError("whole step: Inductor failed\nmore")
            if "sample" in selection:
                compiled_sample(torch.ones(1))
            if "head" in selection:
                raise ValueError("not a compile: no point to blame")
            return {"median_us": 2000.0}

    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    builds = Builds()  # an error no point's compile raised: the row fails, the lock is still written
    us, left_out, error = time_compile_baseline(builds, "points", {})
    assert us is None and error == "torch.compile (points) of every point failed: ValueError: not a compile: " \
        "no point to blame" and "sample" in left_out and len(builds.timed) == 2 and resets == [1]
    builds = Builds()
    us, left_out, error = time_compile_baseline(builds, "points", {"head": _stalled_compile("head")})
    assert us == 2000.0 and error is None and len(builds.timed) == 2 and "sample" not in builds.timed[1]
    assert left_out == {"head": "stalled", "sample": "torch.compile failed in the end-to-end build "
                        "(TypeError: list indices must be integers or slices, not NoneType)"}
    us, left_out, error = time_compile_baseline(builds, "max-autotune-no-cudagraphs", {})
    assert us is None and left_out == {} and error == \
        "torch.compile (max-autotune-no-cudagraphs) of the whole step failed: RuntimeError: whole step: Inductor failed"
    report = {"target": "t", "preset": "p", "dtype": "bf16", "command": "c", "gpu": None, "environment": {},
              "reference_ms": 2.0, "locked_ms": 1.0, "torch_compile_ms": None, "speedup": 2.0,
              "speedup_vs_torch_compile": None, "floor_ms": 0.5, "fraction_of_floor": 0.5,
              "kernels_per_layer": {"reference": {}, "locked": {}}, "points": [],
              "torch_compile_baseline": "max-autotune-no-cudagraphs", "torch_compile_error": error}
    md = report_markdown(report).splitlines()
    assert "| torch.compile of the whole reference step (max-autotune-no-cudagraphs) | failed | |" in md
    assert error in md


def _stalled_compile(point):
    from workbench.search import CandidateResult, PointResult

    stalled = CandidateResult(point, "torch_compile", "torch_compile", None, False, skipped="stalled")
    return PointResult(point, "torch", None, 9.0, 9.0, 0.02, [stalled])


def test_a_locked_set_that_is_the_reference_reports_the_reference_time(tmp_path):
    """When nothing beats the reference end to end, the locked build is the reference build: one
    timing, speed-up 1.00x, never two timings of the same build whose noise reads as a slow-down."""
    from workbench.search import PointResult, Search

    runner = _tiny_runner()
    search = Search(runner, calls={}, out_dir=str(tmp_path))
    timed = []
    search.time_build = lambda selection, configs=None, **kw: timed.append(dict(selection)) or \
        {"median_us": 100.0 + len(timed), "spread": 0.01, "reps": 50}
    final = search.finalize({"boundary": PointResult("boundary", "torch", None, 5.0, 5.0, 0.02, [])})
    assert timed == [{}] and final["locked"] is final["reference"] and final["selection"] == {}


def test_a_choice_stays_when_reverting_it_slows_the_step_beyond_the_steps_noise(tmp_path, monkeypatch):
    """The H200 decode re-lock dropped `dense_mlp`, whose reversal slowed a 3.57 ms step by 1.3% at a
    0.25% spread over 50 reps (runs/optimize-decode-b1-beam-501b-tp8/NOTES.md): the op-level 2%
    minimum is not a whole step's noise. The step's band comes from its spread and reps: the same
    1.3% from 6 reps with a 5% spread is within it, and then the paired timing decides: noise when its
    rounds scatter as widely; a 0.06% gain is noise at any spread."""
    import random

    from workbench import gates
    from workbench.search import MIN_STEP_BAND, PAIRED_ROUND_S, PointResult, Search, step_band

    class Passing:
        passed = True

        def to_dict(self):
            return {"gate": "model", "passed": True}

    monkeypatch.setattr(gates, "model_gate", lambda *a, **kw: Passing())
    search = Search(_tiny_runner(), calls={}, out_dir=str(tmp_path))
    saves = {"dense_mlp": 48.0, "head": 2.0}  # us of the step each choice saves
    spread = {"spread": 0.0025, "reps": 50}
    scatter = random.Random(0)

    def time_build(selection, configs=None, budget_s=None, **kw):
        us = 3572.0 + sum(us for p, us in saves.items() if p not in selection)
        if budget_s == PAIRED_ROUND_S:  # a paired round scatters as the step's spread says
            us *= 1 + scatter.gauss(0.0, spread["spread"] / 2.56)
        return {"median_us": us, **spread}

    search.time_build = time_build
    results = {p: PointResult(p, "triton", None, 10.0, 5.0, 0.02, []) for p in saves}
    assert step_band(spread) == MIN_STEP_BAND
    assert search.finalize(results)["selection"] == {"dense_mlp": "triton"}
    spread.update(spread=0.05, reps=6)
    assert step_band(spread) > 48.0 / 3572.0
    final = search.finalize(results)
    assert final["selection"] == {} and final["paired"]["band"] > 50.0 / 3572.0


def test_choices_each_within_the_noise_go_only_if_the_step_without_them_all_stays_within_it(tmp_path, monkeypatch):
    """Session 10's prefill lock dropped attn_out, dense_mlp, sample and head one by one, each reverted
    within the step's band of the set before it: 289.0 -> 299.0 ms in all. Each choice is reverted
    alone against the whole set; those within the band go together, and only if the step without all
    of them still times within the band."""
    from workbench import gates
    from workbench.search import PointResult, Search, step_band

    passing = gates.GateReport("model", "set", [gates.CheckResult("logits", "prefill", True, 0.0, 1.0)])
    monkeypatch.setattr(gates, "model_gate", lambda *a, **kw: passing)
    search = Search(_tiny_runner(), calls={}, out_dir=str(tmp_path))
    timing = {"spread": 0.0025, "reps": 50}
    assert 3572.0 * step_band(timing) == pytest.approx(17.86)

    def finalize(saves):
        search.time_build = lambda selection, configs=None, **kw: {
            "median_us": 3572.0 + sum(us for p, us in saves.items() if p not in selection), **timing}
        return search.finalize({p: PointResult(p, "triton", None, 10.0, 5.0, 0.02, []) for p in saves})

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
    from workbench.optimize import noise_line
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
        tmp_path, monkeypatch):
    """Session 25's prefill lock: four choices each reverted within the step's 1.8% band, and the set
    without them timed 236.905 ms against 234.627 ms with them, also within the band, so they were
    dropped (runs/optimize-prefill-8x2k-beam-501b-tp8/README.md, session 25). Builds timed minutes apart
    carry the device's drift; rule 3 decides the drop by the two builds timed in alternating rounds,
    whose ratios cancel a steady drift. Here every timing runs 0.1% slower than the one before: the
    choices, worth 1.2% of the step together, stay; worth 0.3%, they still go."""
    from workbench import gates
    from workbench.search import PAIRED_ROUNDS, PointResult, Search

    passing = gates.GateReport("model", "set", [gates.CheckResult("logits", "prefill", True, 0.0, 1.0)])
    monkeypatch.setattr(gates, "model_gate", lambda *a, **kw: passing)
    search = Search(_tiny_runner(), calls={}, out_dir=str(tmp_path))
    calls = []

    def finalize(saves):
        def time_build(selection, configs=None, **kw):
            calls.append(sorted(selection))
            us = 234600.0 + sum(s for p, s in saves.items() if p not in selection)
            return {"median_us": us * (1 + 0.001 * len(calls)), "spread": 0.045, "reps": 26}

        calls.clear()
        search.time_build = time_build
        return search.finalize({p: PointResult(p, "triton", None, 10.0, 5.0, 0.02, []) for p in saves})

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


def test_a_candidate_tied_with_the_choice_at_the_op_level_is_tried_end_to_end(tmp_path, monkeypatch):
    """Session 26's decode re-lock kept experts:triton_rows without PDL: its PDL twin timed 21 us a step
    faster alone, within the op band, so the incumbent stayed; swapped into that lock's step it made the
    step 5.2% faster (runs/optimize-decode-b1-beam-501b-tp8/session26-rejected/swap-experts-pdl.json).
    Rule 4: such a candidate, faster by at least CHALLENGE_SHARE of the step, is tried end to end in a
    paired timing and taken only if the step is faster with it beyond the band and the set passes the
    model gate; smaller ties (head's 0.4 us here) are not tried."""
    from workbench import gates
    from workbench.optimize import challenge_lines, locked_point_us
    from workbench.search import CHALLENGE_SHARE, CandidateResult, PointResult, Search

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
    search = Search(_tiny_runner(), calls={}, out_dir=str(tmp_path))

    def finalize(pdl_saves):
        def time_build(selection, configs=None, **kw):
            us = 3036.0 + (3000.0 if "experts" not in selection else 0.0) + (25.0 if "head" not in selection else 0.0)
            us -= pdl_saves if (configs or {}).get("experts", {}).get("pdl") else 0.0
            return {"median_us": us, "spread": 0.0025, "reps": 50}

        search.time_build = time_build
        return search.finalize(results)

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


def test_a_paired_gain_reads_as_slower_or_faster():
    from workbench.search import slower_by

    assert (slower_by(0.0042), slower_by(-0.0043), slower_by(0.0)) == ("0.42% slower", "0.43% faster", "0.00% slower")


def test_paired_gain_and_its_band():
    """The paired rule's numbers: the median of the rounds' ratios and three standard errors of it,
    within [MIN_STEP_BAND, MAX_BAND]; one wild round moves the median little but widens the band."""
    from workbench.search import MAX_BAND, MIN_STEP_BAND, paired_gain

    steady = paired_gain([[100.0, 101.0]] * 10)
    assert steady["gain"] == pytest.approx(0.01) and steady["band"] == MIN_STEP_BAND
    rounds = [[100.0, 101.0 + (0.4 if i % 2 else -0.4)] for i in range(10)]
    noisy = paired_gain(rounds)
    sd = 0.4 / 100 * (10 / 9) ** 0.5
    assert noisy["gain"] == pytest.approx(0.01) and noisy["band"] == pytest.approx(3 * 1.25 * sd / 10 ** 0.5)
    wild = paired_gain([[100.0, 101.0]] * 9 + [[100.0, 160.0]])
    assert wild["gain"] == pytest.approx(0.01) and wild["band"] == MAX_BAND
    assert paired_gain([[100.0, 101.0]])["band"] == MAX_BAND  # one round has no spread to trust


def test_an_end_to_end_stage_ended_midway_resumes_from_its_journal(tmp_path, monkeypatch):
    """At prefill-8x2k the end-to-end stage outlasts one device command (session 9's
    runs/optimize-prefill-8x2k-beam-501b-tp8/logs/12-*.log lost eight reverted builds' timings). Each
    build's timing and gate is journaled as it is made: a finalize ended midway and resumed times only
    the builds it had not made, and decides as one uninterrupted run does."""
    from workbench import gates
    from workbench.search import PAIRED_ROUNDS, PointResult, Search

    gated = []
    passing = gates.GateReport("model", "set", [gates.CheckResult("logits", "prefill", True, float("nan"), 1.0)])
    monkeypatch.setattr(gates, "model_gate", lambda *a, **kw: gated.append(1) or passing)
    search = Search(_tiny_runner(), calls={}, out_dir=str(tmp_path))
    saves = {"dense_mlp": 48.0, "head": 2.0, "route": 30.0}  # head's 2 us are noise: dropped, re-timed
    timed, limit = [], [None]

    def time_build(selection, configs=None, **kw):
        if len(timed) == limit[0]:
            raise TimeoutError("the command's time limit")
        timed.append(sorted(selection))
        return {"median_us": 3572.0 + sum(us for p, us in saves.items() if p not in selection),
                "spread": 0.0025, "reps": 50}

    search.time_build = time_build
    results = {p: PointResult(p, "triton", {"BLOCK": 64}, 10.0, 5.0, 0.02, []) for p in saves}
    whole = search.finalize(results)
    builds = list(timed)
    # reference, all three, each reverted, then the paired rounds of the set with and without head; the
    # set without head is the head-reverted build, not timed again
    assert whole["selection"] == {"dense_mlp": "triton", "route": "triton"}
    assert len(builds) == 5 + 2 * PAIRED_ROUNDS

    journal, saves_made = {}, []
    timed.clear(), gated.clear()
    limit[0] = 3
    with pytest.raises(TimeoutError):
        search.finalize(results, journal=journal, save=lambda: saves_made.append(len(journal)))
    assert saves_made == [1, 2, 3, 4] and gated == [1]  # the gate, then three timings, each saved
    timed.clear(), gated.clear()
    limit[0] = None
    resumed = search.finalize(results, journal=json.loads(json.dumps(journal)))
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
    again = search.finalize(results, journal=broken)
    assert timed == builds[:2] + builds[3:] and gated == [1, 1]
    assert again["selection"] == whole["selection"]
    # so is a paired timing cut short; the journal's builds are reused around it
    done = json.loads(json.dumps(broken))
    paired_key = next(k for k in done if k.startswith('["paired"'))
    done[paired_key]["rounds"] = done[paired_key]["rounds"][:3]
    timed.clear()
    assert search.finalize(results, journal=done)["paired"]["rounds"] == whole["paired"]["rounds"]
    assert timed == builds[5:]


def _noisy_search(tmp_path, reference_us: list[float]):
    """A boundary search on beam-tiny whose reference times read `reference_us` in turn and whose only
    candidate (Triton, gate passed) times 100 us: what the search decides from those timings."""
    from workbench.search import CandidateResult, Search

    runner = _tiny_runner()
    search = Search(runner, calls={"boundary": {"sliding": 2}}, out_dir=str(tmp_path), backends=("triton",))
    timings = iter(reference_us)
    search._step_time = lambda v, config, workloads: {"step_us": next(timings), "spread": 0.01, "recompiles": 0}
    search._try = lambda v, config, workloads, ref_us: CandidateResult(
        v.point, v.name, v.backend, config, True, step_us=100.0, spread=0.01, speedup=ref_us / 100.0)
    return search, timings


def test_one_slow_reference_timing_does_not_set_the_noise_band(tmp_path):
    """The prefill search once timed the experts reference twice ~2x apart: the two-timing band (0.99,
    runs/optimize-prefill-8x2k-beam-501b-tp8/search/experts.json) kept a 10x faster kernel out. Timings
    are added until two agree within MAX_BAND; those two give the reference time and the band."""
    from workbench.search import MAX_BAND, MIN_BAND

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
    """The H200 decode search timed eleven experts configs at 2.5x their time with 28-35% spreads and
    so chose a config by noise (runs/optimize-decode-b1-beam-501b-tp8/NOTES.md, session 29): such a
    candidate is timed once more after the others, and the quieter timing stands (noisier: kept)."""
    from workbench.registry import get
    from workbench.search import NOISY_SPREAD, CandidateResult, Search

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

    search = Search(_tiny_runner(), calls={"boundary": {"sliding": 2}}, out_dir=str(tmp_path), backends=("triton",))
    search._step_time, search._try = step_time, tried
    result = search.search_point("boundary")
    assert retimed == [configs[0], configs[2]]  # only the two past NOISY_SPREAD, after all the others
    assert repr(result.config) == configs[0] and result.choice_us == 80.0
    noisy = result.candidate("triton", eval(configs[0]))
    assert noisy.noisy_timing == {"step_us": 250.0, "spread": 0.3} and noisy.spread == 0.02
    kept = result.candidate("triton", eval(configs[2]))  # its second timing was noisier: the first stands
    assert kept.step_us == 90.0 and kept.noisy_timing is None
    assert Search(_tiny_runner(), calls={"boundary": {"sliding": 2}}, out_dir=str(tmp_path),
                  backends=("triton",))._load("boundary").candidate("triton", eval(configs[0])).noisy_timing
    from dataclasses import asdict

    from rich.console import Console

    from workbench.progress import ConsoleProgress

    console = Console(record=True, width=200)
    ConsoleProgress(console).event({"type": "candidate_retimed", "point": "boundary", "result": asdict(noisy)})
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
    from workbench.search import MAX_BAND, PointResult

    search, _ = _noisy_search(tmp_path, [])
    search._save("boundary", PointResult("boundary", "torch", None, 2844.0, 2844.0, 0.99, []))
    assert search._load("boundary") is None
    search._save("boundary", PointResult("boundary", "torch", None, 2844.0, 2844.0, MAX_BAND, []))
    assert search._load("boundary") is not None


def test_a_result_searched_without_a_library_is_searched_again_once_it_is_installed(tmp_path, monkeypatch):
    """A point searched while CuTe DSL (or FlashInfer) was missing never tried its variants: once the
    library is there, the cached result is not reused; while it is still missing, it is."""
    from workbench import search as searchmod
    from workbench.search import PointResult

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
    from workbench.search import CandidateResult, PointResult

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
    with open(search._cache_file("boundary")) as f:
        saved = json.load(f)
    del saved["gate_version"]  # as written before GATE_VERSION
    with open(search._cache_file("boundary"), "w") as f:
        json.dump(saved, f)
    result = search.search_point("boundary")
    assert gated == [("triton", {"num_warps": 4})] and result.choice == "triton"
    assert result.candidates[0].gate["regated"]
    search.search_point("boundary")
    assert len(gated) == 1  # the file now carries the version
    with open(search._cache_file("boundary")) as f:
        saved = json.load(f)
    saved["gate_version"] = gates.GATE_VERSION - 1
    with open(search._cache_file("boundary"), "w") as f:
        json.dump(saved, f)
    verdict["passed"] = False
    result = search.search_point("boundary")  # searched again: the stubbed timings pick triton at 100 us
    assert len(gated) == 2 and result.reference_us == 1000.0


def test_a_result_cached_under_older_gates_has_its_gate_failures_gated_again(tmp_path, monkeypatch):
    """A check relaxed since a result was cached (GATE_VERSION) may pass a candidate the older gates
    failed, which was never timed: it is gated again, and if it passes now the point is searched again;
    a failure that still fails leaves the cached result in use. Skipped candidates were never gated."""
    from workbench import gates
    from workbench.search import CandidateResult, PointResult

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
        with open(search._cache_file("boundary")) as f:
            saved = json.load(f)
        saved["gate_version"] = gates.GATE_VERSION - 1
        with open(search._cache_file("boundary"), "w") as f:
            json.dump(saved, f)

    cache_under_older_gates()
    result = search.search_point("boundary")
    assert gated == ["triton"] and result.reference_us == 100.0  # still fails: the cached result stands
    cache_under_older_gates()
    passes.add("triton")
    result = search.search_point("boundary")  # searched again: the stubbed timings time the reference at 1000 us
    assert gated[:2] == ["triton", "triton"] and result.reference_us == 1000.0


def test_report_counts_pdl_candidates_apart_from_their_backend():
    """The per-backend column shows what launching with PDL gained: triton and triton+pdl apart."""
    from workbench.optimize import backend_bests
    from workbench.search import CandidateResult, PointResult

    def cand(variant, backend, config, us, passed=True):
        return CandidateResult("boundary", variant, backend, config, passed, step_us=us)

    result = PointResult("boundary", "triton", {"num_warps": 8, "pdl": True}, 4000.0, 240.0, 0.02, [
        cand("torch", "torch", None, 4000.0), cand("triton", "triton", {"num_warps": 8}, 330.0),
        cand("triton", "triton", {"num_warps": 8, "pdl": True}, 240.0),
        cand("triton", "triton", {"num_warps": 4, "pdl": True}, 100.0, passed=False)])
    assert backend_bests(result) == {"triton+pdl": 0.24, "triton": 0.33, "torch": 4.0}


def test_reference_key_leaves_out_kernels_other_variants_import_on_use(monkeypatch):
    """The reference profile and the whole-step compile baselines are keyed by what the reference runs:
    an edit to experts:triton's kernels (imported inside a function, on that variant's first call)
    leaves the key as it is, though it moves the reference's source hash; an edit to the reference's
    module, to what importing it runs, or to a module the reference function imports itself moves it.
    An edit to the model or the step runner moves the profile's step key."""
    import io
    from types import SimpleNamespace

    from workbench import lock

    real_open, edits = open, set()

    def fake_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        if os.path.relpath(path, lock.ROOT) in edits and "b" in mode:
            return io.BytesIO(f.read() + b"\n# edited\n")
        return f

    def key_after(*paths):
        edits.clear()
        edits.update(paths)
        return lock.reference_key("experts"), lock.source_hash("experts", "torch")

    monkeypatch.setattr(lock, "open", fake_open, raising=False)
    key, src = key_after()
    kernels = "workbench/variants/_triton_moe.py"
    kernels_key, kernels_src = key_after(kernels)
    assert kernels_key == key and kernels_src != src
    assert key_after("workbench/variants/experts.py")[0] != key
    assert key_after("beam_model/functional.py")[0] != key  # experts.py imports swiglu from it

    # The model and the step runner key every profile too (optimize.STEP_MODULES)
    from workbench.optimize import STEP_MODULES

    key_after()
    step = lock.module_key(*STEP_MODULES)
    key_after(kernels)
    assert lock.module_key(*STEP_MODULES) == step
    for edited in ("beam_model/model.py", "beam_model/kv_cache.py", "workbench/targets.py"):
        key_after(edited)
        assert lock.module_key(*STEP_MODULES) != step, edited

    def reference_importing_kernels(x):  # only its source is read
        from workbench.variants import _triton_moe
        return _triton_moe.fused_experts(x)

    real_get = lock.get
    monkeypatch.setattr(lock, "get", lambda point, name: SimpleNamespace(
        fn=reference_importing_kernels, source_file=real_get(point, name).source_file))
    key = key_after()[0]
    assert key_after(kernels)[0] != key


def test_report_says_when_the_files_are_not_the_commit():
    """The GPU host's copy of the tree carries a stale .git: its commit alone would name other code."""
    from workbench.optimize import code_line

    clean = code_line({"git_commit": "abc", "git_dirty": False, "git_tree": "t1"})
    assert clean == "commit abc (files: git tree t1)"
    dirty = code_line({"git_commit": "abc", "git_dirty": True, "git_tree": "t2"})
    assert dirty == "commit abc, files changed since (files: git tree t2)"
    assert code_line({"git_commit": None}) == "commit None"


def test_in_step_costs_are_a_report_column(run, tmp_path, monkeypatch):
    """`--in-step`: after the lock, the locked step against it with each point stood in for; each point's
    cost lands in report.json and in a report.md column, and the run folder keeps in_step.json."""
    out, _, _ = run
    resumed = str(tmp_path / "in-step")
    shutil.copytree(out, resumed)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    events = []
    report = optimize(OptimizeOptions(target="decode-b1", preset="beam-tiny", dtype=torch.float32,
                                      device=torch.device("cpu"), out_dir=resumed, points=POINTS_SEARCHED,
                                      command="pytest", in_step_s=0.01), on_event=events.append)
    with open(os.path.join(resumed, "in_step.json")) as f:
        costs = json.load(f)["costs"]
    by_point = {p["point"]: p for p in report["points"]}
    for point, c in costs.items():
        assert by_point[point]["in_step_ms"] == c["cost_ms"]
    assert by_point["attention"]["in_step_ms"] is None  # no stand-in: its compound's stands in for it
    assert report["in_step"]["rounds"] == 2 and any(e["type"] == "in_step" for e in events)
    md = open(os.path.join(resumed, "report.md")).read()
    header = next(line for line in md.splitlines() if line.startswith("| point |"))
    assert "cost in the running step, ms" in header
    boundary = next(line for line in md.splitlines() if line.startswith("| boundary |"))
    assert boundary.count("|") == header.count("|") and f"| {costs['boundary']['cost_ms']:.3f} |" in boundary
    # without it, no column
    assert "cost in the running step" not in open(os.path.join(out, "report.md")).read()
