"""Lock files (workbench/lock.py) as optimize writes them: the lock selects the variants in the model,
verifies, names every kind of tampering, keys variants by their code, and is refused where it does not hold."""

import os

import pytest
import torch
import yaml

from workbench import lock as lockmod
from workbench.lock import Lock, verify
from workbench.registry import POINTS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_lock_selects_the_variants_in_the_model(finished_run):
    out, report, _ = finished_run
    lock, problems = Lock.load(os.path.join(out, "lock.yaml"))
    assert problems == []
    assert set(lock.points) == set(POINTS)
    from beam_model import BeamForCausalLM

    model = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32, variants=lock.selection)
    assert model.ops.selection == lock.selection


def test_the_gate_evidence_locked_is_the_chosen_configs():
    from workbench.search_results import CandidateResult, PointResult

    def gated(block):
        return CandidateResult("boundary", "triton", "triton", {"block": block}, True,
                               gate={"subject": f"boundary:triton {{'block': {block}}}", "passed": True})

    r = PointResult("boundary", "triton", {"block": 8}, 10.0, 5.0, 0.02, [gated(4), gated(8)])
    assert r.candidate("triton", {"block": 8}).gate["subject"].endswith("{'block': 8}")
    assert r.candidate("triton", {"block": 16}) is None and r.candidate("torch", None) is None
    for run_dir in ("optimize-decode-b1-beam-501b-tp8", "optimize-prefill-8x2k-beam-501b-tp8"):
        lock, _ = Lock.load(os.path.join(ROOT, "runs", run_dir, "lock.yaml"))
        for point, entry in lock.points.items():  # the committed locks' evidence names each locked config
            if entry.get("config"):
                assert str(entry["config"]) in entry["gate"]["subject"], (run_dir, point)


def test_lock_verifies(finished_run):
    out, _, _ = finished_run
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


def test_lock_show_names_the_fusion_that_runs_a_members_work(finished_run, tmp_path, capsys, monkeypatch):
    """`workbench lock show`: with attention_out locked at a fused variant, attention's and attn_out's
    rows say what runs in their place, not the reference variant left in their entries."""
    from workbench.cli import main

    monkeypatch.setenv("COLUMNS", "300")
    out, _, _ = finished_run
    path = _tampered(out, tmp_path, lambda raw: raw["points"].update(
        attention_out={**raw["points"].get("attention_out", raw["points"]["attention"]), "variant": "triton"},
        attention={**raw["points"]["attention"], "variant": "torch"}))
    main(["lock", "show", path])
    rows = {line.split("│")[1].strip(): line for line in capsys.readouterr().out.splitlines() if line.count("│") > 3}
    assert "run by attention_out:triton" in rows["attention"] and "run by attention_out:triton" in rows["attn_out"]
    assert "run by" not in rows["boundary"] and "run by" not in rows["attention_out"]
    main(["lock", "show", os.path.join(out, "lock.yaml")])  # the fixture's lock: no fusion selected
    assert "run by" not in capsys.readouterr().out


def test_edited_timing_is_detected(finished_run, tmp_path):
    out, _, _ = finished_run
    path = _tampered(out, tmp_path, lambda raw: raw["end_to_end"].update(locked_us=0.001))
    result = verify(path, run_gates=False)
    assert not result.ok and any("digest" in p for p in result.problems)


def test_missing_point_is_detected(finished_run, tmp_path):
    out, _, _ = finished_run
    path = _tampered(out, tmp_path, lambda raw: raw["points"].pop("experts"))
    result = verify(path, run_gates=False)
    assert any("points missing" in p and "experts" in p for p in result.problems)


def test_a_drafters_point_may_be_absent_only_where_the_step_runs_no_drafter(finished_run, tmp_path):
    """Locks of the target's steps, written before `draft_attention` existed, stay whole; a draft step's is not."""
    out, _, _ = finished_run
    lock, _ = Lock.load(os.path.join(out, "lock.yaml"))
    points = {p: e for p, e in lock.points.items() if p != "draft_attention"}
    for target, missing in ((lock.target, False), ("draft-b1", True)):
        path = str(tmp_path / f"{target}.yaml")
        Lock(model=lock.model, target=target, environment=lock.environment, points=points).save(path)
        _, problems = Lock.load(path)
        assert any("points missing" in p and "draft_attention" in p for p in problems) == missing, (target, problems)


def test_changed_variant_source_is_detected(finished_run, monkeypatch):
    out, _, _ = finished_run
    real = lockmod.source_hash
    monkeypatch.setattr(lockmod, "source_hash",
                        lambda point, name: "0" * 16 if point == "boundary" else real(point, name))
    result = verify(os.path.join(out, "lock.yaml"), run_gates=False)
    assert any(p.startswith("boundary: source of") for p in result.problems), result.problems


def test_a_point_the_step_never_calls_changes_nothing_the_lock_holds(finished_run, tmp_path, monkeypatch):
    """An entry of `calls: 0` (the experts of a drafter's step) whose code changed is a note, not a problem; the
    same change where the step calls the point (or where the lock records no calls) is a problem."""
    out, _, _ = finished_run
    real = lockmod.source_hash
    monkeypatch.setattr(lockmod, "source_hash",
                        lambda point, name: "0" * 16 if point == "experts" else real(point, name))
    lock, _ = Lock.load(os.path.join(out, "lock.yaml"))
    assert lock.points["experts"]["calls"] > 0  # optimize records the reference step's calls
    for calls, fails in ((0, False), (1, True), (None, True)):
        points = {p: {k: v for k, v in e.items() if k != "calls"} for p, e in lock.points.items()}
        if calls is not None:
            points["experts"]["calls"] = calls
        path = str(tmp_path / f"calls-{calls}.yaml")
        Lock(model=lock.model, target=lock.target, environment=lock.environment, points=points).save(path)
        result = verify(path, run_gates=False)
        assert any(p.startswith("experts: source of") for p in result.problems) == fails, (calls, result.problems)
        assert any(n.startswith("experts: source of") and "never calls" in n for n in result.notes) == (not fails)


def test_verify_names_the_file_that_changed(finished_run, monkeypatch):
    """A lock records each covered file's hash: a kernel module edited under a point names itself,
    not just the variant's module (a variant's hash covers every module its module imports)."""
    out, _, _ = finished_run
    real_files, real_hash = lockmod.source_files, lockmod.source_hash
    kernel = "workbench/variants/kernels/tensor_parallel.py"  # imported by every boundary variant, no other

    def edited(point, name):
        files = real_files(point, name)
        return {**files, kernel: "f" * 16} if kernel in files else files

    monkeypatch.setattr(lockmod, "source_files", edited)
    monkeypatch.setattr(lockmod, "source_hash", lambda point, name: "0" * 16 if kernel in real_files(point, name)
                        else real_hash(point, name))
    problems = verify(os.path.join(out, "lock.yaml"), run_gates=False).problems
    named = [p for p in problems if "source of" in p]
    assert named and all(p.endswith(f": {kernel} (edited)") for p in named), problems


def test_a_change_to_tuning_config_lists_only_leaves_a_lock_of_a_named_config_valid(finished_run, tmp_path,
                                                                                    monkeypatch):
    """Adding a tuning config to a variant's module used to make every lock of that module stale,
    though a lock entry names the config it runs. A lock keeps each variant's code key (the covered
    files' code without their config lists): a change to config lists only is a note, not a
    problem. Other code changes, and an entry running the default config (read off such a list, it
    may be), still need the whole source hash."""
    lock, _ = Lock.load(os.path.join(finished_run[0], "lock.yaml"))
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


def test_other_environment_is_refused_for_serving(finished_run):
    out, _, _ = finished_run
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


def test_a_torch_compile_entry_pins_the_code_it_compiles():
    """The compiled variant's function lives in the registry; its lock entry must still change
    when the point's reference module does."""
    from workbench.registry import get

    assert get("attention", "torch_compile").source_file == get("attention", "torch").source_file
    assert lockmod.source_hash("attention", "torch_compile") != lockmod.source_hash("boundary", "torch_compile")


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


def test_code_key_matches_only_its_own_code_and_code_text_keeps_only_code(tmp_path, monkeypatch):
    """The token text ignores comments, docstrings, blank lines, layout and config lists, and keeps
    f-strings whole."""
    from types import SimpleNamespace

    from workbench import lock
    from workbench.code_text import code_text

    module = tmp_path / "point.py"
    module.write_text("X_CONFIGS = [1]\n\ndef f(x):\n    return f'{x + 1:>4}' + 'a'\n")
    monkeypatch.setattr(lock, "_source_paths", lambda point, variant: [str(module)])
    monkeypatch.setattr(lock, "get", lambda point, variant: SimpleNamespace(configs=[]))
    assert lock.code_key_matches(lock.code_key("p", "v"), "p", "v")
    assert not lock.code_key_matches("0" * 16, "p", "v") and not lock.code_key_matches(None, "p", "v")

    base = code_text(module.read_text())
    assert base.splitlines() == ["def", "f", "(", "x", ")", ":", "NEWLINE", "INDENT", "return", "f'{x + 1:>4}'",
                                 "+", "'a'", "NEWLINE", "DEDENT", "ENDMARKER"]
    assert code_text("# note\nX_CONFIGS = [1,\n    2]\n\n\ndef f(x):  # why\n    return f'{x + 1:>4}' + 'a'\n") == base
    assert code_text("def f(x):\n    return f'{x + 2:>4}' + 'a'\n") != base
    documented = '"""Module."""\nX_CONFIGS = [1]\n\ndef f(x):\n    """Why."""\n    return f\'{x + 1:>4}\' + \'a\'\n'
    assert code_text(documented) == base
    assert code_text("X_CONFIGS = [1]\n\ndef f(x):\n    return f'{x + 1:>4}' + 'a'\n", configs=True) != base


def test_profile_refuses_a_lock_that_fails_verification(finished_run, tmp_path, capsys):
    from workbench.cli import main

    out, _, _ = finished_run
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


def test_reference_key_leaves_out_kernels_other_variants_import_on_use(monkeypatch):
    """The reference profile and the whole-step compile baselines are keyed by what the reference runs:
    an edit to experts:triton's kernels (imported inside a function of that variant's module, on its
    first call) leaves the key and the reference's source hash as they are; an edit to the reference's
    module, to what importing it runs, or to a module the reference function imports itself moves it.
    An edit to the model or the step runner moves the profile's step key."""
    import io
    from types import SimpleNamespace

    from workbench import lock

    real_open, edits = open, set()

    def fake_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        if os.path.relpath(path, lock.ROOT) in edits and "b" in mode:
            return io.BytesIO(f.read() + b"\nEDITED = 1\n")
        return f

    def key_after(*paths):
        edits.clear()
        edits.update(paths)
        return lock.reference_key("experts"), lock.source_hash("experts", "torch")

    monkeypatch.setattr(lock, "open", fake_open, raising=False)
    key, src = key_after()
    kernels = "workbench/variants/kernels/moe.py"
    kernels_key, kernels_src = key_after(kernels)
    assert kernels_key == key and kernels_src == src  # experts/__init__.py imports no kernels
    assert key_after("workbench/variants/experts/__init__.py")[0] != key
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
        from workbench.variants.kernels import moe as _triton_moe
        return _triton_moe.fused_experts(x)

    real_get = lock.get
    monkeypatch.setattr(lock, "get", lambda point, name: SimpleNamespace(
        fn=reference_importing_kernels, source_file=real_get(point, name).source_file, origin=None))
    key = key_after()[0]
    assert key_after(kernels)[0] != key
