"""The agent protocol on beam-tiny (CPU): `variant new` scaffolds that pass `check` and `bench` at once,
the static check, plugin loading, and `optimize --agent` driven by a scripted stand-in agent
(scripted.py beside this file) through every verdict: banned tricks, wrong, stale, right-only-while-gated,
a crash, a hanging agent, a hanging variant, and a correct faster variant that is accepted.

Worker processes import torch (~3 s each on CPU), so each judged attempt costs that much; the
static rejections start none.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from harness_helpers import made_once, tiny_options

from workbench import registry
from workbench.agent import plugins, scaffold
from workbench.agent.judge import Task, decide
from workbench.agent.static_check import check_source
from workbench.cli import main
from workbench.points import Workload

HERE = os.path.dirname(os.path.abspath(__file__))
AGENT = f"{sys.executable} {os.path.join(HERE, 'scripted.py')}"
sys.path.insert(0, HERE)
import scripted  # noqa: E402

FAST_TIMING = {"max_seconds": 0.3, "warmup": 3, "min_reps": 30}


# ------------------------------------------------------------------------------ worker

def test_the_worker_runs_the_entry_point_its_caller_names():
    """The caller names MODULE:FUNCTION and the child calls it with the string arguments, so the worker
    imports none of its callers (the judge, the CLI); the function's return value is the exit code."""
    from workbench.agent import worker

    ok = worker.run("builtins:print", ["hello"], timeout=60)
    assert (ok.returncode, ok.killed, ok.reason) == (0, None, None)
    failed = worker.run("sys:exit", ["no such thing"], timeout=60)
    assert failed.returncode == 1 and "no such thing" in failed.reason
    with pytest.raises(ValueError, match="module:function"):
        worker.run("workbench.agent.judge", [])


# ------------------------------------------------------------------------------ variant new

def test_variant_new_scaffold_passes_check_and_bench(tmp_path, capsys):
    d = str(tmp_path / "plugins")
    assert main(["variant", "new", "boundary", "--backend", "torch", "--name", "mine", "--dir", d, "--json"]) == 0
    made = json.loads(capsys.readouterr().out)
    path = made["path"]
    assert path == os.path.join(d, "boundary__mine.py")
    src = open(path).read()
    assert "def boundary_mine(y, h, w, *, eps, group=None):" in src
    assert '@register("boundary", "mine", "torch")' in src
    assert "args[0] [1, 64]" in src and "Contract: `boundary(y, h, w, *, eps, group=None)" in src
    assert "#" not in src.split('"""')[-1]  # comment-free below the docstring
    assert check_source(src) == []
    assert "mine" not in registry.variants("boundary")  # the CLI never imports plugin code in-process

    code = main(["check", "mine", "--dir", d, "--json", "--batch", "1", "--prefill", "2", "8", "40",
                 "--seeds", "1", "--no-capture"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["passed"], out
    (row,) = out["results"]
    assert (row["point"], row["variant"], row["status"]) == ("boundary", "mine", "pass")

    code = main(["bench", "boundary", "--variants", "mine", "--dir", d, "--preset", "beam-tiny", "--device", "cpu",
                 "--context", "64", "--max-seconds", "0.2", "--min-reps", "10", "--json"])
    rows = {r["variant"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert code == 0 and rows["mine"]["error"] is None and rows["mine"]["median_us"] > 0
    assert "mine" not in registry.variants("boundary")

    # The same name again, or a name the package already has, is refused before anything is written.
    assert main(["variant", "new", "boundary", "--name", "mine", "--dir", d]) == 2
    assert main(["variant", "new", "boundary", "--name", "triton", "--dir", d]) == 2
    assert "already registered" in capsys.readouterr().err


def test_scaffold_of_every_point_is_clean_and_inlines_the_reference():
    for point in registry.POINTS:
        src = scaffold.render(point, "x", "triton")
        assert check_source(src, point) == [], point
        compile(src, point, "exec")
        assert f"def {point}_x(" in src and "@register" in src


def test_plugin_name_clash_is_a_clear_error(tmp_path):
    clash = tmp_path / "boundary__clash.py"
    source = scaffold.render("boundary", "clash", "torch")
    clash.write_text(source.replace('"boundary", "clash"', '"boundary", "torch"'))
    with pytest.raises(plugins.PluginError, match=r"registers boundary:torch, which .*boundary\S*\.py already"):
        plugins.load_file(str(clash))
    ok = tmp_path / "boundary__fine.py"
    ok.write_text(scaffold.render("boundary", "fine", "torch"))
    found = plugins.load_file(str(ok))
    try:
        assert [v.qualname for v in found] == ["boundary:fine"]
        with pytest.raises(plugins.PluginError, match="already"):
            plugins.load_file(str(ok))  # loading twice is the same clash
    finally:
        plugins.unload(found)
    assert "fine" not in registry.variants("boundary")


# ------------------------------------------------------------------------------ static check

BANNED = {  # behaviour of the stand-in agent -> the rule its violation names
    "calls_reference": "the reference", "uses_time": "timing", "cuda_stream": "extra CUDA streams",
    "threading": "threads", "reads_file": "file access",
}


@pytest.mark.parametrize("behaviour", sorted(BANNED))
def test_static_check_rejects_each_banned_trick(tmp_path, behaviour):
    (tmp_path / "variant.py").write_text(scaffold.render("boundary", "x", "torch"))
    scripted.write(str(tmp_path), behaviour)
    violations = check_source((tmp_path / "variant.py").read_text(), "boundary")
    assert BANNED[behaviour] in {v.rule for v in violations}, violations
    assert all(v.line > 0 for v in violations)


def test_static_check_more_tricks():
    rules = lambda src: {v.rule for v in check_source(src, "boundary")}  # noqa: E731
    assert "the reference" in rules("from workbench.registry import reference\n")
    assert "the reference" in rules("import workbench.variants.boundary as b\n")
    assert "profiling" in rules("import torch\nwith torch.profiler.profile():\n    pass\n")
    assert "timing" in rules("import torch\ne = torch.cuda.Event(enable_timing=True)\n")
    assert "network" in rules("import urllib.request\n")
    assert "processes" in rules("import os\nos.system('ls')\n")
    assert "dynamic code" in rules("eval('1')\n")
    assert "reaching other objects" in rules("def f(): pass\nf.__globals__\n")
    assert rules("import torch\nfrom workbench.variants.kernels.triton_common import triton\n") == set()


def test_suspect_speedups_need_trust():
    wl = Workload(dtype="fp32")
    result = {"stage": "done", "candidate_us": 10.0, "incumbent_us": 100.0, "band": 0.01,
              "recheck": {"checked": 4, "failed": []}}
    task = Task("boundary", "x", {"sliding": wl}, {"sliding": 1}, floor_us=50.0)
    v = decide(result, task)
    assert not v.accepted and v.stage == "suspect" and v.suspect and "--trust" in v.reason
    task.trust = True
    assert decide(result, task).accepted
    assert decide(result, Task("boundary", "x", {"sliding": wl}, {"sliding": 1}, floor_us=5.0)).accepted
    slow = {**result, "candidate_us": 99.5}
    assert decide(slow, task).stage == "not_faster"


def test_a_wide_but_faster_interval_is_a_speed_up():
    """On a loaded machine a much faster candidate's round-by-round ratios spread widely; what counts is
    whether the upper end of their median's interval (ratio + band) stays below 1, not how wide it is."""
    result = {"stage": "done", "candidate_us": 602.0, "incumbent_us": 4540.0, "band": 0.5,
              "recheck": {"checked": 4, "failed": []}}
    task = Task("boundary", "x", {"sliding": Workload(dtype="fp32")}, {"sliding": 1}, floor_us=5.0)
    v = decide(result, task)
    assert v.accepted and v.timing["band"] == 0.5
    assert decide({**result, "band": 0.9}, task).stage == "not_faster"  # the interval reaches past 1


# ------------------------------------------------------------------------------ optimize --agent

PLAYLIST = ["calls_reference", "uses_time", "cuda_stream", "threading", "reads_file", "wrong", "stale",
            "late_garbage", "crash", "hang", "loops", "faster"]
EXPECTED = {  # behaviour -> (stage, text in the reason or the failing check)
    "calls_reference": ("static", "reference"), "uses_time": ("static", "time"),
    "cuda_stream": ("static", "torch.cuda.Stream"), "threading": ("static", "threading"),
    "reads_file": ("static", "open"), "wrong": ("gate", "accuracy"), "stale": ("gate", "fresh_inputs"),
    "late_garbage": ("recheck", "timed calls"), "crash": ("gate", "SIGSEGV"), "hang": ("agent", "budget"),
    "loops": ("worker", "timed out"), "faster": ("accepted", "faster than slow_incumbent"),
}


SLOW_INCUMBENT = scripted.slow("slow_incumbent")

# The run's setup, as a plugin file imported by this process and, like any plugin the caller imported, by
# the step sandbox that times the end-to-end builds. torch.compile costs a minute of CPU here and is not
# what this test is about: the search sees it as unavailable, and the "torch.compile" build of the report
# runs the references. The reference does its work 40 times (same values), so the search picks the slow
# incumbent and the accepted variant's gain in the step stands far above a shared CPU's noise band.
SETUP = """import dataclasses
import functools

from workbench import registry

for point in registry.POINTS:
    registry.variants(point)["torch_compile"] = registry.Variant(
        point, "torch_compile", "torch_compile", registry.reference(point).fn,
        supports=lambda w: "not compiled in this test")
fast = registry.reference("boundary")


@functools.wraps(fast.fn)  # the scaffold still inlines the real reference's source
def slow_boundary(*args, **kwargs):
    for _ in range(39):
        fast.fn(*args, **kwargs)
    return fast.fn(*args, **kwargs)


registry.variants("boundary")["torch"] = dataclasses.replace(fast, fn=slow_boundary)


@registry.register("boundary", "test_setup", "torch", supports=lambda w: "this file's setup, not a candidate")
def test_setup(*args, **kwargs):
    raise AssertionError("never called")
"""


def _make_agent_run(tmp_path_factory):
    """(run folder, report, events, attempts) of an optimize run with the scripted agent on boundary."""
    from workbench.agent.loop import AgentOptions
    from workbench.optimize import optimize

    out = str(tmp_path_factory.mktemp("agent-run"))
    events = []
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)  # as a user's CPU run
        for point in registry.POINTS:  # restored afterwards: the setup file replaces them
            mp.setitem(registry.variants(point), "torch_compile", registry.get(point, "torch_compile"))
        mp.setitem(registry.variants("boundary"), "torch", registry.reference("boundary"))
        # The incumbent the agent must beat is a plugin variant doing the reference's math 10 times (the
        # judge's worker loads its file too), so the test can require that the accepted variant is locked.
        folder = tmp_path_factory.mktemp("incumbent")
        (folder / "slow_incumbent.py").write_text(SLOW_INCUMBENT)
        (folder / "setup.py").write_text(SETUP)
        plugins.load_file(str(folder / "setup.py"), static=False)
        plugins.load_file(str(folder / "slow_incumbent.py"))
        agent = AgentOptions(f"{AGENT} {','.join(PLAYLIST)}", rounds=len(PLAYLIST), budget_s=3.0,
                             worker_timeout_s=40.0, timing=FAST_TIMING)
        report = optimize(tiny_options(out, points=("boundary",), agent=agent), on_event=events.append)
    with open(os.path.join(out, "agent", "attempts.jsonl")) as f:
        attempts = [json.loads(line) for line in f]
    # the live Search a stage event hands a UI ends with the run (and holds locks: it cannot be pickled)
    events = [dataclasses.replace(e, search=None) if hasattr(e, "search") else e for e in events]
    return out, report, events, attempts


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory):
    """`_make_agent_run`, made once for all the session's workers (`made_once`); what it registers in the
    process that makes it is undone there afterwards."""
    run = made_once(tmp_path_factory, "agent_run", lambda: _make_agent_run(tmp_path_factory))
    yield run
    for a in run[3]:
        registry.variants("boundary").pop(a["variant"], None)
    registry.variants("boundary").pop("slow_incumbent", None)
    registry.variants("boundary").pop("test_setup", None)


def test_every_attempt_is_recorded_with_its_verdict(agent_run):
    _, _, _, attempts = agent_run
    assert [a["round"] for a in attempts] == list(range(1, len(PLAYLIST) + 1))
    for behaviour, a in zip(PLAYLIST, attempts):
        stage, text = EXPECTED[behaviour]
        assert a["stage"] == stage, (behaviour, a["stage"], a["reason"])
        assert text in a["reason"] + str(a.get("failed_check")), (behaviour, a["reason"])
        assert a["accepted"] == (behaviour == "faster"), behaviour
        assert a["point"] == "boundary" and a["variant"] == f"agent_r{a['round']}"
        if stage not in ("agent",):
            assert len(a["source_hash"]) == 16
    by = dict(zip(PLAYLIST, attempts))
    assert by["hang"]["agent"]["timed_out"] and by["hang"]["agent"]["seconds"] < 10
    assert by["crash"]["worker"]["returncode"] == 0  # the candidate's sandbox died, not the judge's worker
    assert by["wrong"]["gate_passed"] is False and by["late_garbage"]["gate_passed"] is True
    assert by["faster"]["timing"]["speedup"] > 1 and by["faster"]["gate_passed"]
    assert by["faster"]["seed_base"] != by["wrong"]["seed_base"]  # fresh inputs each round


def test_task_folders_carry_the_contract_and_the_last_verdict(agent_run):
    out, _, _, attempts = agent_run
    root = os.path.join(out, "agent", "boundary")
    first = open(os.path.join(root, "round-1", "TASK.md")).read()
    assert "## Contract" in first and "roofline floor" in first and "fp32 1e-05" in first and "None yet." in first
    second = open(os.path.join(root, "round-2", "TASK.md")).read()
    assert "Round 1: rejected at stage `static`" in second and "previous.py" in second
    assert os.path.isfile(os.path.join(root, "round-2", "previous.py"))
    assert os.path.isfile(os.path.join(root, "round-9", "worker.log"))


def test_accepted_variant_goes_through_finalize_and_the_lock(agent_run):
    out, report, events, attempts = agent_run
    accepted = next((a for a in attempts if a["accepted"]), None)
    assert accepted, [(a["stage"], a["reason"]) for a in attempts]
    name = accepted["variant"]
    assert os.path.isfile(accepted["accepted_file"])
    # This process never imported it: it ran in its sandbox (ended with the run, unregistered then) and the
    # builds were timed in a step sandbox.
    path = os.path.abspath(accepted["accepted_file"])
    assert not [m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == path]
    assert name not in registry.variants("boundary")
    with open(os.path.join(out, "end_to_end.json")) as f:
        final = json.load(f)["final"]
    assert final["locked"]["process"].startswith("step-sandbox-")
    # It became the point's choice: the end-to-end step was timed with and without it.
    reverts = [e for e in events if e.kind == "revert" and e.point == "boundary"]
    assert reverts, "the accepted variant never reached the end-to-end check"
    from workbench.lock import Lock

    lock, problems = Lock.load(os.path.join(out, "lock.yaml"))
    assert problems == []
    locked = lock.points["boundary"]
    assert locked["variant"] == name, "the accepted variant did not join the lock"
    assert locked["source"].endswith(f"boundary__{name}.py") and locked["gate"]["passed"]
    assert next(p for p in report["points"] if p["point"] == "boundary")["variant"] == name


def test_a_lock_naming_an_agent_variant_verifies_in_a_fresh_process(agent_run):
    out, _, _, _ = agent_run
    done = subprocess.run([sys.executable, "-m", "workbench.cli", "lock", "verify", os.path.join(out, "lock.yaml"),
                           "--no-gates", "--json"], capture_output=True, text=True, timeout=120)
    problems = json.loads(done.stdout)["problems"]
    assert not [p for p in problems if p.startswith("boundary")], problems


def test_lock_verify_gates_an_agent_variant_without_importing_it(agent_run):
    """The gates run here on the variant in its sandbox: code it runs on import cannot reach them."""
    from workbench.lock import verify

    out, _, _, attempts = agent_run
    accepted = next((a for a in attempts if a["accepted"]), None)
    assert accepted, [(a["stage"], a["reason"]) for a in attempts]
    result = verify(os.path.join(out, "lock.yaml"), device="cpu")
    assert result.ok, result.problems
    assert result.gate_reports["boundary"]["passed"] and result.gate_reports["model"]["passed"]
    path = os.path.abspath(accepted["accepted_file"])
    assert not [m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == path]
    assert accepted["variant"] not in registry.variants("boundary")  # its sandbox ended with the verification


def test_lock_gate_runs_an_agent_variant_in_its_sandbox(agent_run, capsys):
    """`lock gate` runs a lock naming an accepted file as `lock verify` does: the variant in its sandbox."""
    out, _, _, attempts = agent_run
    accepted = next(a for a in attempts if a["accepted"])
    assert main(["lock", "gate", os.path.join(out, "lock.yaml"), "--device", "cpu", "--json"]) == 0
    gated = json.loads(capsys.readouterr().out)
    assert gated["passed"] and f"boundary:{accepted['variant']}" in gated["report"]["subject"]
    path = os.path.abspath(accepted["accepted_file"])
    assert not [m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == path]
    assert accepted["variant"] not in registry.variants("boundary")  # its sandbox ended with the gate


def test_cli_passes_agent_options(monkeypatch, tmp_path):
    import workbench.optimize as opt

    seen = {}
    monkeypatch.setattr(opt, "optimize", lambda opts, on_event=None: seen.setdefault("opts", opts) and
                        {"stopped": True, "pending": [], "searched": [], "out_dir": str(tmp_path)})
    main(["optimize", "--agent", "my-agent --flag", "--rounds", "2", "--agent-budget", "60", "--out", str(tmp_path),
          "--worker-timeout", "90", "--worker-memory", "2", "--json"])
    agent = seen["opts"].agent
    assert (agent.command, agent.rounds, agent.budget_s, agent.points) == ("my-agent --flag", 2, 60.0, 1)
    assert (agent.worker_timeout_s, agent.worker_mem_bytes) == (90.0, 2 << 30)
