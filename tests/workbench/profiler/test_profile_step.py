"""The profiled step (workbench/profiler/attribution.py) as optimize profiles the locked build."""

import torch
from harness_helpers import tiny_runner


def test_a_compiled_point_is_timed_by_the_cpu_profiler():
    """On the CPU the profiler counts the ATen ops under a point's range; torch.compile's generated
    kernels have none, so a compiled point read ~0 us in the locked step's profile. Its compiled
    graph's own time is counted now."""
    from workbench.profiler.attribution import profile_step

    runner = tiny_runner()
    runner.rebind({"boundary": "torch_compile"})
    boundary = next(p for p in profile_step(runner).points if p.point == "boundary")
    assert boundary.variant == "torch_compile" and boundary.time_us > 0
    assert boundary.kernels >= boundary.calls  # at least one compiled graph's kernels per call


def test_the_profiled_step_runs_as_the_timed_one_in_inference_mode():
    """A profile taken after the timed builds must not raise "Inplace update to inference tensor outside
    InferenceMode" on a variant's workspace made in a timed (inference-mode) step, written again by a
    profiled step run outside it. FlashInfer's prefill wrapper keeps such a buffer; a planted variant
    keeps one here."""
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
        runner = tiny_runner()
        runner.rebind({"boundary": "keeps_workspace"})
        runner()  # as a timed step runs
        assert workspace[0].is_inference()
        profile_step(runner)
    finally:
        del table["keeps_workspace"]
    assert workspace[0].item() >= 3
