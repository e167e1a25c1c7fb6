"""The events of an optimize run, one dataclass per kind: what the console and the TUI are told.

`workbench.optimize`, the per-point search, the end-to-end stage and the agent loop call their
`on_event` callback with these as things happen; `workbench.progress` prints them, the TUI draws
them (from `Event.as_dict()`, the form its views read). An event reports what was decided; a
consumer never decides anything from it.

What it must never do: carry a figure that is not in the run's files or results (the console and the
TUI show what the run wrote), or import anything above the search's records.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

from workbench.search_results import CandidateResult, PointResult


@dataclass(frozen=True)
class Event:
    kind: ClassVar[str]

    def as_dict(self) -> dict:
        """{"type": kind, field: value, ...}: search results as their JSON form, and the optional fields
        (those that default to None) only when set."""
        out: dict[str, Any] = {"type": self.kind}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue
            out[f.name] = value.to_dict() if isinstance(value, (CandidateResult, PointResult)) else value
        return out


# ---- the run's stages ------------------------------------------------------------------------------

@dataclass(frozen=True)
class StageStarted(Event):
    """A stage begins. The search stage names the points in the order they will be searched and
    carries the live `Search`, so a UI can skip points and pause (`search.skip`, `search.resume`)."""
    kind: ClassVar[str] = "stage"
    stage: str
    preset: str | None = None
    order: list[str] | None = None
    search: Any = None


@dataclass(frozen=True)
class Profiled(Event):
    """The reference step's profile (`workbench.profiler.Profile`)."""
    kind: ClassVar[str] = "profile"
    profile: Any


@dataclass(frozen=True)
class Stopped(Event):
    """The budget was spent before these points' searches; the same command resumes."""
    kind: ClassVar[str] = "stopped"
    pending: list[str]


@dataclass(frozen=True)
class InStepLine(Event):
    """A line of the in-step cost timing's log."""
    kind: ClassVar[str] = "in_step"
    line: str


@dataclass(frozen=True)
class Done(Event):
    """The lock and the report are written (`report`: report.json's content)."""
    kind: ClassVar[str] = "done"
    report: dict


# ---- the per-point search --------------------------------------------------------------------------

@dataclass(frozen=True)
class PointStarted(Event):
    kind: ClassVar[str] = "point_start"
    point: str


@dataclass(frozen=True)
class PointCached(Event):
    """The point's result was read back from the run folder, nothing searched."""
    kind: ClassVar[str] = "point_cached"
    point: str
    result: PointResult


@dataclass(frozen=True)
class PointDone(Event):
    kind: ClassVar[str] = "point_done"
    point: str
    result: PointResult


@dataclass(frozen=True)
class CandidateTried(Event):
    """A candidate gated and timed, or skipped with the reason."""
    kind: ClassVar[str] = "candidate"
    point: str
    result: CandidateResult


@dataclass(frozen=True)
class CandidateRetimed(Event):
    """A candidate timed with a spread past the noisy spread, timed again: the quieter timing stands."""
    kind: ClassVar[str] = "candidate_retimed"
    point: str
    result: CandidateResult


@dataclass(frozen=True)
class Regated(Event):
    """A cached result's choice (or gate failure) gated again under the current gates."""
    kind: ClassVar[str] = "regated"
    point: str
    variant: str
    config: dict | None
    was_failed: bool
    passed: bool


# ---- the end-to-end stage --------------------------------------------------------------------------

@dataclass(frozen=True)
class EndToEndResumed(Event):
    """Builds timed and gated by an earlier run of the folder are reused (`builds`: how many of the
    stage's journal; None: the stage's whole result)."""
    kind: ClassVar[str] = "resumed_end_to_end"
    builds: int | None = None


@dataclass(frozen=True)
class ModelGateDropped(Event):
    kind: ClassVar[str] = "model_gate_dropped"
    point: str
    variant: str
    why: str


@dataclass(frozen=True)
class Challenged(Event):
    """A candidate tied with the point's choice at the op level, tried in the whole step: the set with
    it failed the model gate (`model_gate`), or its paired timing against the choice (`gain`: how much
    slower the step is with the choice, `band`) decided whether it `won`."""
    kind: ClassVar[str] = "challenger"
    point: str
    variant: str
    config: dict | None
    op_us: float
    choice_op_us: float
    won: bool
    model_gate: str | None = None
    rounds: list | None = None
    gain: float | None = None
    band: float | None = None
    process: str | None = None


@dataclass(frozen=True)
class Reverted(Event):
    """The chosen set timed with one choice reverted to its reference."""
    kind: ClassVar[str] = "revert"
    point: str
    reverted_us: float
    locked_us: float


@dataclass(frozen=True)
class PairedTimed(Event):
    """The set with and without the choices that each reverted within the step's noise, timed in
    alternating rounds (`gain`: how much slower without them); `kept` when beyond the band."""
    kind: ClassVar[str] = "paired"
    choices: dict[str, str]
    rounds: list
    gain: float
    band: float
    kept: bool
    process: str | None = None


@dataclass(frozen=True)
class DroppedAsNoise(Event):
    kind: ClassVar[str] = "dropped_as_noise"
    choices: dict[str, str]
    band: float
    before_us: float
    after_us: float


# ---- agent rounds ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class AgentRound(Event):
    kind: ClassVar[str] = "agent_round"
    point: str
    round: int
    task: str


@dataclass(frozen=True)
class AgentAttempt(Event):
    kind: ClassVar[str] = "agent_attempt"
    point: str
    round: int
    variant: str
    accepted: bool
    stage: str
    reason: str
