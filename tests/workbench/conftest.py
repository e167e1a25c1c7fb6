"""Fixtures of the harness tests: one tiny optimize run, made once and shared (read-only: a test
that changes a run folder works on a copy)."""

import pytest
from harness_helpers import tiny_options


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
    """(run folder, report, events) of `workbench optimize` on beam-tiny (CPU), boundary and qkvg_proj searched."""
    from workbench.optimize import optimize

    out = str(tmp_path_factory.mktemp("opt"))
    events = []
    with pytest.MonkeyPatch.context() as mp:
        # As a user's CPU run: interpreted Triton kernels are for correctness tests, not for timing.
        mp.delenv("TRITON_INTERPRET", raising=False)
        report = optimize(tiny_options(out), on_event=events.append)
    return out, report, events
