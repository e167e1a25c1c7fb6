"""Noise bands (workbench/noise.py): when one timing is faster than another beyond the noise."""

import math

import pytest
import torch
from harness_helpers import FAST

from workbench import noise
from workbench.points import Call
from workbench.timing import Timing


def test_paired_gain_and_its_band():
    """The paired rule's numbers: the median of the rounds' ratios and three standard errors of it,
    within [MIN_STEP_BAND, MAX_BAND]; one wild round moves the median little but widens the band."""
    from workbench.noise import MAX_BAND, MIN_STEP_BAND, paired_gain

    steady = paired_gain([[100.0, 101.0]] * 10)
    assert steady["gain"] == pytest.approx(0.01) and steady["band"] == MIN_STEP_BAND
    rounds = [[100.0, 101.0 + (0.4 if i % 2 else -0.4)] for i in range(10)]
    noisy = paired_gain(rounds)
    sd = 0.4 / 100 * (10 / 9) ** 0.5
    assert noisy["gain"] == pytest.approx(0.01) and noisy["band"] == pytest.approx(3 * 1.25 * sd / 10 ** 0.5)
    wild = paired_gain([[100.0, 101.0]] * 9 + [[100.0, 160.0]])
    assert wild["gain"] == pytest.approx(0.01) and wild["band"] == MAX_BAND
    assert paired_gain([[100.0, 101.0]])["band"] == MAX_BAND  # one round has no spread to trust


def test_compare_and_noise_band():
    assert noise.relative_difference(100, 110) == pytest.approx(0.1)
    assert noise.compare(90.0, 100.0, 0.05)        # 10% faster beats a 5% band
    assert not noise.compare(97.0, 100.0, 0.05)    # 3% is inside the band
    assert not noise.compare(110.0, 100.0, 0.0)    # slower never wins
    fast = Timing(50.0, 49.0, 51.0, 0.04, 10, 1, 1, 1, False)
    slow = Timing(60.0, 59.0, 61.0, 0.03, 10, 1, 1, 1, False)
    assert noise.compare(fast, slow, 0.1) and not noise.compare(slow, fast, 0.1)
    x = torch.randn(4096)
    band = noise.noise_band(torch.sin, lambda i: Call((x,)), device="cpu", rotate_bytes=0, **FAST)
    assert band >= 0 and math.isfinite(band)  # its size depends on what else runs on this machine


def test_noise_band_is_two_independent_runs(monkeypatch):
    medians = iter([100.0, 104.0])
    runs = []

    def fake_time_call(fn, make_call, **kw):
        runs.append(kw)
        return Timing(next(medians), 0, 0, 0, 1, 1, 1, 1, False)

    monkeypatch.setattr(noise, "time_call", fake_time_call)
    assert noise.noise_band(None, None, device="cpu", warmup=3) == pytest.approx(0.04)
    assert runs == [{"device": "cpu", "warmup": 3}] * 2
