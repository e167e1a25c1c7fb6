"""The roofline (workbench/roofline.py): the device's ceilings, measured once and cached, and a call's floor."""

import json

import pytest
from harness_helpers import CEILINGS

from workbench import roofline
from workbench.points import PointSpec, Workload


def test_floor_is_the_larger_of_memory_and_compute_time():
    ceilings = {"bandwidth_Bps": 4e12, "matmul_flops": 1e15}
    memory_bound = PointSpec("head", None, lambda w: 8_000_000_000, lambda w: 10**12, tolerance={})
    assert roofline.floor_us(memory_bound, Workload(), ceilings) == pytest.approx(2000.0)  # 2 ms of bytes vs 1 ms
    compute_bound = PointSpec("head", None, lambda w: 10**6, lambda w: 5 * 10**12, tolerance={})
    assert roofline.floor_us(compute_bound, Workload(), ceilings) == pytest.approx(5000.0)


def test_ceilings_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("BEAM_WORKBENCH_CACHE", str(tmp_path / "c"))
    calls = []
    monkeypatch.setattr(roofline, "_measure", lambda device: calls.append(device) or dict(CEILINGS))
    assert roofline.measure_device_ceilings("cpu") == CEILINGS and len(calls) == 1
    assert roofline.measure_device_ceilings("cpu") == CEILINGS and len(calls) == 1  # from the file now
    saved = json.loads((tmp_path / "c" / "ceilings.json").read_text())
    assert saved[roofline.device_name("cpu")]["bandwidth_Bps"] == CEILINGS["bandwidth_Bps"]
    roofline.measure_device_ceilings("cpu", refresh=True)
    assert len(calls) == 2


def test_measured_cpu_ceilings_are_positive(tmp_path, monkeypatch):
    monkeypatch.setenv("BEAM_WORKBENCH_CACHE", str(tmp_path))
    c = roofline.measure_device_ceilings("cpu")
    assert c["bandwidth_Bps"] > 1e8 and c["matmul_flops"] > 1e7
