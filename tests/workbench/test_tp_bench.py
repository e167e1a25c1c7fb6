"""`workbench bench boundary --tp N`: the all-reducing point timed on gloo ranks of the CPU, each rank its
own partial sum; a variant's time is its slowest rank's median."""

import json

from workbench.cli import main


def test_boundary_is_timed_on_every_rank(tmp_path, capsys):
    assert main(["bench", "boundary", "--preset", "beam-tiny", "--tp", "2", "--variants", "torch", "--min-reps", "3",
                 "--out", str(tmp_path), "--json"]) == 0
    result = json.loads((tmp_path / "bench-tp.json").read_text())
    assert json.loads(capsys.readouterr().out) == result
    assert (result["world"], result["backend"], result["reps"]) == (2, "gloo", 3)
    (row,) = result["rows"]  # the reference, named or not, once
    assert row["variant"] == "torch" and row["error"] is None and len(row["per_rank_us"]) == 2
    assert row["median_us"] == max(row["per_rank_us"]) > 0 and row["speedup_vs_reference"] == 1.0


def test_a_point_that_never_communicates_is_refused(capsys):
    assert main(["bench", "experts", "--preset", "beam-tiny", "--tp", "2"]) == 2
    assert "experts never communicates" in capsys.readouterr().err


def test_a_variant_that_cannot_run_here_gets_its_reason(capsys):
    assert main(["bench", "boundary", "--preset", "beam-tiny", "--tp", "2", "--variants", "cute", "--min-reps", "2",
                 "--json"]) == 0
    rows = {r["variant"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["torch"]["error"] is None and "unavailable" in rows["cute"]["error"]
    assert rows["cute"]["median_us"] is None and rows["cute"]["speedup_vs_reference"] is None
