"""`workbench profile --in-step` (workbench/profiler/in_step.py): the stand-ins keep their points'
contracts and launch nothing once made, exist only while in use, and each point's cost in the step
is timed against the step itself."""

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from beam_model import BeamForCausalLM
from workbench import registry
from workbench.cli import main
from workbench.points import Workload, spec
from workbench.profiler import in_step
from workbench.targets import StepRunner, for_device, get_target
from workbench.timing import invoke

VIEWS = {"view", "_unsafe_view", "alias", "detach"}


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("point", sorted(in_step.STAND_INS))
def test_each_stand_in_returns_what_its_point_returns_and_computes_nothing(point):
    call = spec(point).make_inputs(Workload(preset="beam-tiny", context=96), torch.device("cpu"), 0)
    ref = invoke(registry.reference(point).fn, call)
    invoke(in_step.STAND_INS[point], call)  # makes its fixed outputs
    with _Ops() as ops:
        got = invoke(in_step.STAND_INS[point], call)
    assert set(ops.seen) <= VIEWS, f"{point}'s stand-in ran {ops.seen}"
    ref, got = (ref, got) if isinstance(ref, tuple) else ((ref,), (got,))
    assert [(t.shape, t.dtype) for t in ref] == [(t.shape, t.dtype) for t in got]


def test_stand_ins_are_registered_only_while_in_use():
    with pytest.raises(RuntimeError, match="inside"):
        with in_step.stand_ins():
            assert all(in_step.STAND_IN in registry.variants(p) for p in in_step.STAND_INS)
            raise RuntimeError("inside")
    assert not any(in_step.STAND_IN in registry.variants(p) for p in in_step.STAND_INS)


def test_groups_name_points_with_a_stand_in():
    assert in_step.check_groups(["route, experts"]) == [("route", "experts")]
    for bad in ("route,attention", ","):
        with pytest.raises(ValueError, match="no stand-in for"):
            in_step.check_groups([bad])


@pytest.mark.parametrize("weights", registry.WEIGHT_FORMATS)
def test_every_point_and_group_is_timed_and_the_runner_is_left_as_it_was(weights):
    model = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32, device="cpu", weights=weights)
    runner = StepRunner(model, for_device(get_target("decode-b1"), torch.device("cpu")))
    selection = model.ops.selection
    r = in_step.in_step_costs(runner, selection, {}, groups=[("route", "experts")], rounds=1, device="cpu",
                              budget_s=0.01, log=lambda line: None)
    # every point stood in for, whatever format its weights are stored in
    assert set(r["costs"]) == set(in_step.STAND_INS) | {"route+experts"}, r["timings"]
    assert all(c["cost_ms"] == pytest.approx(r["step_ms"] - c["step_ms"]) for c in r["costs"].values())
    assert model.ops.selection == selection
    assert not any(in_step.STAND_IN in registry.variants(p) for p in in_step.STAND_INS)


def test_profile_command_writes_each_points_cost_in_the_step(tmp_path, capsys):
    out = tmp_path / "prof"
    assert main(["profile", "--in-step", "--in-step-group", "qk_prep,boundary,route", "--in-step-seconds", "0.01",
                 "--out", str(out), "--json"]) == 0
    r = json.loads((out / "in_step.json").read_text())
    assert r["graphed"] is False and set(r["costs"]) == set(in_step.STAND_INS) | {"qk_prep+boundary+route"}
    assert r["costs"]["qk_prep+boundary+route"]["variants"] == {"qk_prep": "torch", "boundary": "torch",
                                                                 "route": "torch"}
    assert json.loads(capsys.readouterr().out)["in_step"]["step_ms"] == r["step_ms"]
    assert main(["profile", "--in-step-group", "route", "--out", str(out)]) == 2  # needs --in-step
    assert main(["profile", "--in-step", "--in-step-group", "route,nope", "--out", str(out)]) == 2
    assert "no stand-in for ['nope']" in capsys.readouterr().err


def test_the_in_step_table_cuts_no_name_and_no_number_at_80_columns():
    """The H200 run of the decode lock (runs/decode-b1-step-ablation-tp8/): its group of every point
    but the experts has the longest name, which must not squeeze a number column to an ellipsis."""
    from pathlib import Path

    from rich.console import Console

    from workbench.progress import in_step_table

    path = Path(__file__).parents[3] / "runs/decode-b1-step-ablation-tp8/in-step/in_step.json"
    r = json.loads(path.read_text())
    console = Console(width=80, record=True)
    console.print(in_step_table(r))
    text = console.export_text()
    assert "…" not in text
    for label, c in r["costs"].items():
        assert f"{c['cost_ms']:.3f}" in text and all(v in text for v in c["variants"].values())
        assert all(p in text for p in label.split("+"))
