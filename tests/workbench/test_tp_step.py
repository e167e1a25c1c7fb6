"""`workbench profile --tp N`: the decode step of beam-tiny on gloo ranks of the CPU, every boundary
all-reducing across them; the slowest rank's median is the step's time."""

import json

import pytest

from workbench.cli import main
from workbench.tp_step import time_tp_step


@pytest.mark.parametrize("world", [1, 2])
def test_the_step_is_timed_on_every_rank(tmp_path, world, capsys):
    assert main(["profile", "--tp", str(world), "--reps", "3", "--out", str(tmp_path), "--json"]) == 0
    result = json.loads((tmp_path / "tp_step.json").read_text())
    assert json.loads(capsys.readouterr().out) == result
    assert result["world"] == world and result["backend"] == "gloo" and result["preset"] == "beam-tiny"
    assert [r["rank"] for r in result["per_rank"]] == list(range(world))
    assert all(r["reps"] == 3 and r["median_ms"] > 0 and not r["graph"] for r in result["per_rank"])
    assert result["step_ms"] == max(r["median_ms"] for r in result["per_rank"])
    assert result["per_rank"][result["slowest_rank"]]["median_ms"] == result["step_ms"]
    alone = result["per_rank"][0].get("alone")  # one rank: the step without a group times beside it
    assert (alone is not None and alone["median_ms"] > 0 and result["per_rank"][0]["paired_ratio"] > 0) == (world == 1)


def test_a_rank_that_fails_is_named():
    with pytest.raises(RuntimeError, match="the TP step failed: rank 0: .*unknown target 'decode-b2'"):
        time_tp_step("beam-tiny", "decode-b2", 2, reps=1, timeout_s=60)


def test_tp_options_need_each_other(capsys):
    assert main(["profile", "--reps", "3"]) == 2
    assert "--reps times a --tp step" in capsys.readouterr().err
    assert main(["profile", "--tp", "2", "--in-step"]) == 2
    assert "--tp times the ranks' step" in capsys.readouterr().err
