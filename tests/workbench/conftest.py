"""Fixtures of the harness tests: one tiny optimize run, made once and shared (read-only: a test
that changes a run folder works on a copy)."""

import dataclasses

import pytest
from harness_helpers import made_once, tiny_options


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
    """(run folder, report, events) of `workbench optimize` on beam-tiny (CPU), boundary and qkvg_proj
    searched; made once for all the session's workers."""
    from workbench.optimize import optimize

    def make():
        out = str(tmp_path_factory.mktemp("opt"))
        events = []
        with pytest.MonkeyPatch.context() as mp:
            # As a user's CPU run: interpreted Triton kernels are for correctness tests, not for timing.
            mp.delenv("TRITON_INTERPRET", raising=False)
            report = optimize(tiny_options(out), on_event=events.append)
        # the live Search a stage event hands a UI ends with the run (and holds locks: it cannot be pickled)
        return out, report, [dataclasses.replace(e, search=None) if hasattr(e, "search") else e for e in events]

    return made_once(tmp_path_factory, "finished_run", make)
