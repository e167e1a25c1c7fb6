"""Noise bands: when one timing is faster than another by more than the measurement's own noise.

An op's band comes from repeated timings of its reference, bounded to [MIN_BAND, MAX_BAND]; a whole
step's band from its spread and sample count (`step_band`); two builds compared in alternating rounds
get the band of their rounds' ratios (`paired_gain`).

What it must never do: time anything beyond what `noise_band` is asked to time twice, or choose a
variant: the search and the end-to-end stage apply these bands.
"""

from __future__ import annotations

import statistics
from typing import Callable

from workbench.points import Call
from workbench.timing import Timing, time_call

MIN_BAND = 0.02  # never trust a speed-up smaller than 2%, however quiet the machine looked
MAX_BAND = 0.10  # reference timings further apart than this measured something besides the op
# A whole step times far steadier than one op (spreads of 0.1-1.6% on an H200): the op-level
# MIN_BAND would drop choices worth 1-3% of the step.
MIN_STEP_BAND = 0.005


def _us(x) -> float:
    return x.median_us if isinstance(x, Timing) else float(x)


def relative_difference(a, b) -> float:
    """|a - b| / min(a, b) of two medians (Timing or microseconds)."""
    a, b = _us(a), _us(b)
    return abs(a - b) / min(a, b)


def noise_band(fn: Callable, make_call: Callable[[int], Call], **timing_kw) -> float:
    """The incumbent timed twice, independently: the relative difference of the two medians."""
    return relative_difference(time_call(fn, make_call, **timing_kw), time_call(fn, make_call, **timing_kw))


def compare(candidate, incumbent, band: float) -> bool:
    """True only if the candidate is faster than the incumbent by more than the noise band."""
    c, i = _us(candidate), _us(incumbent)
    return (i - c) / i > band


def bounded_band(measured: float, least: float = MIN_BAND) -> float:
    """A noise band from a measured relative spread or gap, within [least, MAX_BAND]."""
    return min(max(least, measured), MAX_BAND)


def step_band(timing: dict) -> float:
    """The band within which a whole step's median is noise: three standard errors of the difference
    of two medians of `reps` timings with this spread ((p90 - p10) / median, 2.56 sigma for a normal
    spread; a median's standard error is 1.25 sigma / sqrt(reps)), within [MIN_STEP_BAND, MAX_BAND].
    Twenty reps of a 300 ms prefill step with a 3% spread give 1.4% (six gave 2.5%); a decode step's 50
    reps with a 0.25% spread give the minimum."""
    sigma = timing["spread"] / 2.56
    return bounded_band(3 * 1.25 * sigma * (2 / timing["reps"]) ** 0.5, MIN_STEP_BAND)


def paired_gain(rounds: list[list[float]]) -> dict:
    """From rounds of [a_us, b_us]: `gain`, the median of b / a - 1 (how much slower b is), and `band`,
    three standard errors of that median (1.25 sd / sqrt(rounds)) within [MIN_STEP_BAND, MAX_BAND]."""
    ratios = [b / a for a, b in rounds]
    sd = statistics.stdev(ratios) if len(ratios) > 1 else float("inf")
    return {"rounds": rounds, "gain": statistics.median(ratios) - 1,
            "band": bounded_band(3 * 1.25 * sd / len(ratios) ** 0.5, MIN_STEP_BAND)}
