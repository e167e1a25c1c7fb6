"""The optimize report (workbench/report.py): report.json's derived fields, report.md, re-rendering a
finished run folder, and the words the console and the TUI share."""

import json
import os

import pytest


def test_report_rerenders_from_the_run_folder(finished_run, tmp_path):
    import shutil

    from workbench.report import rerender

    out, _, _ = finished_run
    copy = str(tmp_path / "run")
    shutil.copytree(out, copy)
    with open(os.path.join(copy, "report.md")) as f:
        written = f.read()
    with open(os.path.join(copy, "report.json")) as f:
        old = json.load(f)
    for p in old["points"]:
        p.pop("best_ms_by_backend")  # as a report written before that field existed
    with open(os.path.join(copy, "report.json"), "w") as f:
        json.dump(old, f)
    assert rerender(copy)["points"] == finished_run[1]["points"]
    with open(os.path.join(copy, "report.md")) as f:
        assert f.read() == written


def test_the_step_floor_is_the_locked_profiles_sum_of_point_floors(finished_run, tmp_path):
    """The step's floor and the per-point floors beside it come from one profile, so from one set of
    measured ceilings (a resumed run's reference profile may be another host start's). A report that
    summed the reference profile's floors is set right when re-rendered."""
    import shutil

    from workbench.report import rerender

    out, report, _ = finished_run
    assert report["floor_ms"] == pytest.approx(sum(p["floor_ms"] or 0.0 for p in report["points"]))
    copy = str(tmp_path / "run")
    shutil.copytree(out, copy)
    with open(os.path.join(copy, "report.json")) as f:
        old = json.load(f)
    old["floor_ms"], old["fraction_of_floor"] = 2 * report["floor_ms"], 2 * report["fraction_of_floor"]
    with open(os.path.join(copy, "report.json"), "w") as f:
        json.dump(old, f)
    again = rerender(copy)
    assert again["floor_ms"] == pytest.approx(report["floor_ms"])
    assert again["fraction_of_floor"] == pytest.approx(report["floor_ms"] / report["locked_ms"])


def test_a_report_from_before_configs_were_recorded_compares_variants_only():
    from workbench.report import against_previous

    step = {"target": "decode-b1", "preset": "p", "dtype": "bf16", "gpu": "g"}
    old = {**step, "locked_ms": 3.6, "points": [{"point": "experts", "variant": "triton", "ms": 1.6},
                                                {"point": "head", "variant": "torch", "ms": 0.07}]}
    new = {**step, "locked_ms": 3.5, "points": [{"point": "experts", "variant": "triton", "config": {"BLOCK_N": 8},
                                                 "ms": 1.5},
                                                {"point": "head", "variant": "triton", "config": None, "ms": 0.05}]}
    assert [c["point"] for c in against_previous(old, new)["changed"]] == ["head"]
    assert against_previous({**old, "gpu": "other"}, new) is None  # another GPU's lock: no comparison


def test_the_report_says_when_no_points_choice_changed_instead_of_an_empty_table():
    from workbench.report import _against_previous_lines

    same = {"locked_ms": 3.0, "git_commit": "abc", "changed": []}
    text = "\n".join(_against_previous_lines(same, 2.9))
    assert "3.000 ms then (commit abc), 2.900 ms now. No point's locked variant or config changed." in text
    assert "| point |" not in text
    moved = {**same, "changed": [{"point": "head", "was": "torch", "was_ms": 0.07, "now": "triton", "now_ms": 0.05}]}
    assert "| head | torch | 0.070 | triton | 0.050 |" in "\n".join(_against_previous_lines(moved, 2.9))


def test_report_names_the_compile_baseline():
    from workbench.report import report_markdown

    report = {"target": "t", "preset": "p", "dtype": "bf16", "command": "c", "gpu": None, "environment": {},
              "reference_ms": 2.0, "locked_ms": 1.0, "torch_compile_ms": 1.5, "speedup": 2.0,
              "speedup_vs_torch_compile": 1.5, "floor_ms": 0.5, "fraction_of_floor": 0.5,
              "kernels_per_layer": {"reference": {}, "locked": {}}, "points": []}
    assert "| torch.compile (every point) | 1.500 | 1.50x |" in report_markdown(report)  # older reports
    report["torch_compile_baseline"] = "max-autotune-no-cudagraphs"
    assert "| torch.compile of the whole reference step (max-autotune-no-cudagraphs) | 1.500 |" \
        in report_markdown(report)


def test_members_of_a_locked_fused_compound_are_reported_as_run_by_it():
    """With attention_out locked at a fused variant, attention's and attn_out's own selections never run
    (the end-to-end stage leaves them at the reference): the report says what runs in their place, not
    that the locked build runs the reference attention."""
    from workbench.report import mark_run_by_compounds, report_markdown

    def point(name, variant):
        return {"point": name, "variant": variant, "backend": variant, "ms": 1.0, "reference_ms": 3.0,
                "reverted_ms": 2.0}
    report = {"target": "t", "preset": "p", "dtype": "bf16", "command": "c", "gpu": None, "environment": {},
              "reference_ms": 2.0, "locked_ms": 1.0, "torch_compile_ms": 1.5, "speedup": 2.0,
              "speedup_vs_torch_compile": 1.5, "floor_ms": 0.5, "fraction_of_floor": 0.5,
              "kernels_per_layer": {"reference": {}, "locked": {}},
              "dropped": {"attention": "triton", "head": "triton"},
              "points": [point("attention", "torch"), point("attn_out", "torch"), point("head", "torch"),
                         point("attention_out", "torch")],
              "previous": {"locked_ms": 1.1, "git_commit": "abc",
                           "changed": [{"point": "attention", "was": "triton", "was_ms": 0.3, "now": "torch",
                                        "now_ms": 3.0}]}}
    mark_run_by_compounds(report)  # the compound at its reference: the members' selections run
    assert not any("run_by" in p for p in report["points"])
    assert "| attention | torch | torch | 1.000 |" in report_markdown(report)
    report["points"][3]["variant"] = "triton"
    mark_run_by_compounds(report)
    assert [p.get("run_by") for p in report["points"]] == ["attention_out:triton"] * 2 + [None, None]
    md = report_markdown(report)
    assert "| attention | run by attention_out:triton | - | - | 3.000 | - | - | - |" in md
    assert "| attn_out | run by attention_out:triton |" in md and "| head | torch | torch | 1.000 |" in md
    assert "noise band: attention:triton (attention_out:triton runs in its place), head:triton." in md
    assert "| attention | triton | 0.300 | run by attention_out:triton | - |" in md


def test_report_counts_pdl_candidates_apart_from_their_backend():
    """The per-backend column shows what launching with PDL gained: triton and triton+pdl apart."""
    from workbench.report import backend_bests
    from workbench.search_results import CandidateResult, PointResult

    def cand(variant, backend, config, us, passed=True):
        return CandidateResult("boundary", variant, backend, config, passed, step_us=us)

    result = PointResult("boundary", "triton", {"num_warps": 8, "pdl": True}, 4000.0, 240.0, 0.02, [
        cand("torch", "torch", None, 4000.0), cand("triton", "triton", {"num_warps": 8}, 330.0),
        cand("triton", "triton", {"num_warps": 8, "pdl": True}, 240.0),
        cand("triton", "triton", {"num_warps": 4, "pdl": True}, 100.0, passed=False)])
    assert backend_bests(result) == {"triton+pdl": 0.24, "triton": 0.33, "torch": 4.0}


def test_report_says_when_the_files_are_not_the_commit():
    """The GPU host's copy of the tree carries a stale .git: its commit alone would name other code."""
    from workbench.report import code_line

    clean = code_line({"git_commit": "abc", "git_dirty": False, "git_tree": "t1"})
    assert clean == "commit abc (files: git tree t1)"
    dirty = code_line({"git_commit": "abc", "git_dirty": True, "git_tree": "t2"})
    assert dirty == "commit abc, files changed since (files: git tree t2)"
    assert code_line({"git_commit": None}) == "commit None"


def test_a_paired_gain_reads_as_slower_or_faster():
    from workbench.report import slower_by

    assert (slower_by(0.0042), slower_by(-0.0043), slower_by(0.0)) == ("0.42% slower", "0.43% faster", "0.00% slower")
