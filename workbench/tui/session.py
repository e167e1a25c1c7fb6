"""One optimize run driven from the TUI: `workbench.optimize.optimize` in a worker thread.

The run's events (`workbench.events`) are posted to the app as messages in their dict form
(`Event.as_dict()`, what the views read), thread-safe and never blocking the run. Pause
and skip go to the live `Search` the run announces with its "search" stage event (`search.resume`,
`search.skip`); asked for before that, they are applied the moment it arrives, in the run's thread,
so none is lost. Closing the app stops the run at its next event: points already searched stay
cached in the run folder and the same command resumes. `profile_target` profiles the target as
`workbench profile` does. Nothing here times, gates or chooses anything itself, and nothing here
writes into a run folder (the library calls do).
"""

from __future__ import annotations

from textual.message import Message

from workbench.dtypes import DTYPE_NAMES
from workbench.events import Event
from workbench.optimize import OptimizeOptions, optimize


class SessionClosed(Exception):
    """Raised inside the run's thread to unwind `optimize` when the app is closing."""


class OptimizeEvent(Message):
    """One event of the run as a dict: {"type": "stage" | "profile" | "point_start" | ... | "done", ...}."""

    def __init__(self, event: dict):
        super().__init__()
        self.event = event


class SearchSession:
    def __init__(self, options: OptimizeOptions, post):
        self.options, self._post = options, post
        self.search = None            # the live workbench.search.Search, once announced
        self.skipped: set[str] = set()
        self.paused = False
        self.closing = False

    def run(self) -> dict | None:
        """The worker thread's body: the whole optimize run; None when the app closed it."""
        try:
            return optimize(self.options, on_event=self._event)
        except SessionClosed:
            return None

    def _event(self, event: Event) -> None:
        if self.closing:
            raise SessionClosed
        e = event.as_dict()
        if e.get("search") is not None:
            self.search = e["search"]
            self.search.skip |= self.skipped
            if self.paused:
                self.search.resume.clear()
        self._post(OptimizeEvent(e))

    # ---- controls, called from the UI thread -------------------------------------------------
    def pause(self, paused: bool) -> None:
        """Paused: the search waits before its next candidate (the current one finishes)."""
        self.paused = paused
        if self.search is not None:
            (self.search.resume.clear if paused else self.search.resume.set)()

    def skip(self, point: str) -> None:
        """Try no more candidates of this point (its reference stays), and do not cache it."""
        self.skipped.add(point)
        if self.search is not None:
            self.search.skip.add(point)

    def close(self) -> None:
        """Stop at the next event; a paused search is released so that it reaches one."""
        self.closing = True
        if self.search is not None:
            self.search.resume.set()


def profile_target(o: OptimizeOptions):
    """One eager step of the target profiled, as `workbench profile` does (the reference build)."""
    from beam_model import BeamForCausalLM
    from workbench.profiler import profile_step
    from workbench.roofline import measure_device_ceilings
    from workbench.targets import StepRunner, for_device, get_target

    model = BeamForCausalLM.from_preset(o.preset, seed=o.seed, dtype=o.dtype, device=o.device)
    target = for_device(get_target(o.target), o.device)
    runner = StepRunner(model, target, use_graph=False)
    return profile_step(runner, workload_for=lambda kind: target.workload(o.preset, DTYPE_NAMES[o.dtype], kind),
                        ceilings=measure_device_ceilings(o.device))
