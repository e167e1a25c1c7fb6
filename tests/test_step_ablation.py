"""scripts/gpu_step_ablation.py on the CPU: a reference lock of beam-tiny, its step timed with points
stood in for by kernel-free stand-ins, and the stand-ins keeping their points' contracts."""

import json
import os
import sys

import pytest
import torch

from workbench import registry
from workbench.bench import invoke
from workbench.lock import Lock
from workbench.points import Workload, spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_step_ablation as ablation  # noqa: E402
import gpu_step_swap  # noqa: E402


@pytest.fixture
def stand_ins(monkeypatch):
    """The stand-ins registered for this test only (gates elsewhere iterate every registered variant)."""
    for point, fn in ablation.STAND_INS.items():
        monkeypatch.setitem(registry.variants(point), ablation.SKIPPED,
                            registry.Variant(point, ablation.SKIPPED, "torch", fn))


@pytest.mark.parametrize("point", sorted(ablation.STAND_INS))
def test_each_stand_in_returns_what_its_point_returns(stand_ins, point):
    call = spec(point).make_inputs(Workload(preset="beam-tiny", context=96), torch.device("cpu"), 0)
    ref, got = invoke(registry.reference(point).fn, call), invoke(ablation.STAND_INS[point], call)
    ref, got = (ref, got) if isinstance(ref, tuple) else ((ref,), (got,))
    assert [(t.shape, t.dtype) for t in ref] == [(t.shape, t.dtype) for t in got]


def test_the_lock_and_its_ablations_are_timed_in_one_process(stand_ins, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_step_swap, "STEP_SAMPLES_S", 0.1)
    lock = Lock(model={"preset": "beam-tiny", "dtype": "bf16"}, target="decode-b1", environment={},
                points={p: Lock.entry(p, "torch") for p in registry.POINTS})
    lock.save(str(tmp_path / "lock.yaml"))
    out = tmp_path / "ablation.json"
    best = ablation.main([str(tmp_path / "lock.yaml"), "--device", "cpu", "--rounds", "1", "--skip",
                          "qk_prep,boundary,route", "--skip", "experts", "--out", str(out)])
    assert set(best) == {"lock", "qk_prep+boundary+route skipped", "experts skipped"}
    assert set(json.loads(out.read_text())["timings"]) == set(best)
    with pytest.raises(SystemExit, match="no stand-in for \\['sample'\\]"):
        ablation.ablations(lock, ["sample"])


def test_the_summary_sets_each_builds_saving_beside_its_points_floors(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"best_ms": {"lock": 2.0, "route skipped": 1.75,
                                                             "route+boundary skipped": 1.5}}))
    (tmp_path / "r.json").write_text(json.dumps({"points": [{"point": "route", "floor_ms": 0.125},
                                                            {"point": "boundary", "floor_ms": 0.001}]}))
    table = ablation.summarize(str(tmp_path / "a.json"), str(tmp_path / "r.json"))
    assert "| route | 1.750 | 0.250 | 0.125 | 2.00 |" in table
    assert "| route+boundary | 1.500 | 0.500 | 0.126 | 3.97 |" in table
