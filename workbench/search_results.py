"""What the per-point search records: each candidate's verdict and timing, and the point's choice.

These are the records `search/<point>.json` holds (`PointResult.to_dict` / `from_dict`), that the
search's events carry and that the report, the TUI and the agent loop read. Plain data: this module
never times, gates or decides anything.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class CandidateResult:
    point: str
    variant: str
    backend: str
    config: dict | None
    gate_passed: bool
    failed_check: str | None = None
    step_us: float | None = None      # this point's time per target step with the candidate
    spread: float | None = None
    speedup: float | None = None      # vs the reference, same run
    skipped: str | None = None        # why it was not tried here
    gate: dict = field(default_factory=dict)
    seconds: float | None = None      # wall time of its gate + timing (first-use JIT builds included)
    compile_s: float | None = None    # of which compilers it started were seen running (`watchdog.py`)
    noisy_timing: dict | None = None  # {"step_us", "spread"} of a first timing past NOISY_SPREAD, replaced

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class PointResult:
    point: str
    choice: str
    config: dict | None
    reference_us: float
    choice_us: float
    band: float
    candidates: list[CandidateResult]

    def to_dict(self) -> dict:
        return asdict(self)

    def candidate(self, variant: str, config: dict | None) -> CandidateResult | None:
        """The candidate of `variant` at `config`: each config of a variant is gated and timed apart."""
        return next((c for c in self.candidates if c.variant == variant and (c.config or None) == (config or None)),
                    None)

    @classmethod
    def from_dict(cls, d: dict) -> PointResult:
        return cls(**{**d, "candidates": [CandidateResult(**c) for c in d["candidates"]]})
