"""What optimize refuses before it writes anything (workbench/preflight.py): a backend that cannot run
here, and a re-lock that could not search the folder's lock's choices."""

import os
import shutil

import pytest
from harness_helpers import POINTS_SEARCHED, STEP_SAMPLES_S, tiny_options

from workbench.lock import Lock
from workbench.optimize import optimize


@pytest.mark.parametrize("named, says", [(["torch", "flashinfer"], "'flashinfer' package, which is not installed"),
                                         (["torch", "trition"], "unknown backend 'trition'")])
def test_optimize_refuses_backends_it_cannot_search(tmp_path, monkeypatch, capsys, named, says):
    """Asked for a backend that cannot run here, optimize stops before it writes anything, naming it;
    it does not search and lock a build without it."""
    from workbench import cli, registry

    def available(b):  # flashinfer missing, wherever the test runs
        return (False, f"backend {b!r} needs the 'flashinfer' package, which is not installed") \
            if b == "flashinfer" else registry.backend_available(b)
    monkeypatch.setattr("workbench.preflight.backend_available", available)
    out = tmp_path / "run"
    assert cli.main(["optimize", "--preset", "beam-tiny", "--device", "cpu", "--out", str(out),
                     "--backends", *named]) == 2
    assert says in " ".join(capsys.readouterr().err.split()) and not out.exists()


def test_optimize_refuses_a_build_timing_of_no_seconds(tmp_path, capsys):
    from workbench import cli

    out = tmp_path / "run"
    assert cli.main(["optimize", "--preset", "beam-tiny", "--device", "cpu", "--out", str(out),
                     "--step-seconds", "0"]) == 2
    assert "--step-seconds must be above 0, got 0.0" in capsys.readouterr().err and not out.exists()


def _lock_boundary_at(out, variant):
    """Plant a lock choice (written as optimize writes it: its digest matches)."""
    path = os.path.join(out, "lock.yaml")
    planted, _ = Lock.load(path)
    planted.points["boundary"] = Lock.entry("boundary", variant)
    planted.save(path)


@pytest.mark.parametrize("locked, options, says", [
    ("cute", {}, "boundary:cute (backend 'cute' needs"),
    ("torch_compile", {"backends": ("torch",)},
     "boundary:torch_compile (backend 'torch_compile' left out of --backends)"),
    ("torch_compile", {"points": ("qkvg_proj",)}, "boundary:torch_compile (boundary is not among --points)"),
    (None, {}, "is not valid YAML"),
])
def test_a_relock_that_cannot_search_the_locks_choices_stops_before_writing(finished_run, tmp_path, monkeypatch, locked,
                                                                           options, says):
    """A run in a folder holding a lock refuses, naming the choice, when it could not search one of
    that lock's choices (a backend missing here: a re-lock once wrote a far slower decode lock on a
    host without FlashInfer), and writes nothing; --force writes over it."""
    out = str(tmp_path / "relock")
    shutil.copytree(finished_run[0], out)
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
    opts = tiny_options(out, **options)
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


def test_the_optimize_command_names_the_lock_choice_it_cannot_search(finished_run, tmp_path, monkeypatch, capsys):
    from workbench import cli

    out = str(tmp_path / "relock")
    shutil.copytree(finished_run[0], out)
    _lock_boundary_at(out, "cute")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = ["optimize", "--preset", "beam-tiny", "--device", "cpu", "--out", out, "--points", *POINTS_SEARCHED,
            "--step-seconds", str(STEP_SAMPLES_S)]
    assert cli.main(args) == 2
    assert "boundary:cute" in " ".join(capsys.readouterr().err.split())
    assert cli.main([*args, "--force"]) == 0  # the search resumes from the folder and locks its own choice
    assert Lock.load(os.path.join(out, "lock.yaml"))[0].selection["boundary"] != "cute"
