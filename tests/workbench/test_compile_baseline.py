"""The torch.compile baselines (workbench/compile_baseline.py): a point whose compile fails or stalled
is kept at its reference, a baseline that cannot be built is a report row saying why."""

import torch
from harness_helpers import tiny_runner


def test_torch_compile_build_leaves_out_a_point_whose_compile_stalled_in_the_search():
    from workbench.compile_baseline import uncompilable
    from workbench.report import report_markdown
    from workbench.search_results import CandidateResult, PointResult

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


def test_whole_step_compile_baseline_runs_the_step_through_torch_compile(monkeypatch):
    """`--compile-baseline MODE`: the whole reference step through torch.compile (a user's baseline);
    the compiler is swapped for Dynamo's eager backend here (the plumbing, not Inductor, is tested)."""

    asked, real = [], torch.compile

    def compile_eagerly(fn, *, mode=None, dynamic=None):
        asked.append((mode, dynamic))
        return real(fn, backend="eager", dynamic=dynamic)

    monkeypatch.setattr(torch, "compile", compile_eagerly)
    runner = tiny_runner()
    eager = runner().clone()
    runner.rebind({}, compile_mode="max-autotune-no-cudagraphs")
    assert torch.equal(runner(), eager) and asked == [("max-autotune-no-cudagraphs", False)]
    runner.rebind({})  # back to eager, op by op
    assert torch.equal(runner(), eager) and len(asked) == 1


def test_a_point_whose_compile_fails_end_to_end_is_kept_at_its_reference(monkeypatch):
    """A compile that passed the search can still fail in the end-to-end build (the prefill run's
    `sample`: an Inductor codegen error): that point joins those kept at their reference, the build is
    timed again from a clean compiler state, and the report says why; a build that fails otherwise (a
    whole-step compile, an error no point's compile raised: the prefill run's second attempt) costs the
    report its row, not the lock."""
    from workbench.compile_baseline import time_compile_baseline
    from workbench.compiled import compiled
    from workbench.registry import get
    from workbench.report import report_markdown

    def broken(*a, **kw):
        raise TypeError("list indices must be integers or slices, not NoneType")

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: broken)
    compiled_sample = compiled(get("sample", "torch").fn)  # as the build's sample:torch_compile

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
    from workbench.search_results import CandidateResult, PointResult

    stalled = CandidateResult(point, "torch_compile", "torch_compile", None, False, skipped="stalled")
    return PointResult(point, "torch", None, 9.0, 9.0, 0.02, [stalled])


def test_the_plain_baseline_compiles_the_fastest_gated_plain_pytorch_variant_of_each_point():
    """`--compile-baseline plain-MODE`: the whole step compiled in MODE from each point's fastest plain-PyTorch
    candidate that passed its gate and beat the reference; a faster candidate that failed its gate, one of
    another backend (a kernel, a compiled one) and a plain one slower than the reference are not taken."""
    from workbench.compile_baseline import plain_choices, time_compile_baseline
    from workbench.search_results import CandidateResult, PointResult

    def cand(point, variant, backend, us, passed=True):
        return CandidateResult(point, variant, backend, None, passed, step_us=us)

    results = {
        "qkvg_proj": PointResult("qkvg_proj", "triton", None, 30.0, 8.0, 0.02, [
            cand("qkvg_proj", "packed_views", "torch", 12.0), cand("qkvg_proj", "packed", "torch", 10.0),
            cand("qkvg_proj", "broken", "torch", 5.0, passed=False), cand("qkvg_proj", "triton", "triton", 8.0),
            cand("qkvg_proj", "torch_compile", "torch_compile", 9.0)]),
        "route": PointResult("route", "triton", None, 9.0, 4.0, 0.02, [
            cand("route", "slow_plain", "torch", 11.0), cand("route", "triton", "triton", 4.0)]),
    }
    assert {p: c.variant for p, c in plain_choices(results).items()} == {"qkvg_proj": "packed"}

    class Builds:
        timed = []

        def time_build(self, selection, configs=None, *, compile_mode=None):
            self.timed.append((selection, configs, compile_mode))
            return {"median_us": 1500.0}

    us, left_out, error = time_compile_baseline(Builds(), "plain-max-autotune-no-cudagraphs", results)
    assert (us, left_out, error) == (1500.0, {}, None)
    assert Builds.timed == [({"qkvg_proj": "packed"}, {}, "max-autotune-no-cudagraphs")]
