"""`workbench optimize --tp N` on gloo ranks of the CPU: a boundary candidate right on one process that
skips the all-reduce fails the search's gate for two ranks; the reference and locked steps are timed on
the ranks at once and land in the lock and the report."""

import pytest
import yaml
from harness_helpers import tiny_options, tiny_runner

from workbench.agent.plugins import load_file, unload
from workbench.optimize import optimize
from workbench.search import Search

SKIPS_THE_ALL_REDUCE = '''
from beam_model.functional import rms_norm
from workbench.registry import register


@register("boundary", "skips_all_reduce", "torch")
def boundary(y, h, w, *, eps, group=None):  # the boundary's math on this rank's partial sum alone
    a, b = w["residual"][0], w["residual"][1]
    h_new = (a * h.float() + b * rms_norm(y, w["post_norm"], eps)).to(h.dtype)
    return h_new, None if w["next_norm"] is None else rms_norm(h_new, w["next_norm"], eps).to(h.dtype)
'''


def test_a_candidate_that_skips_the_all_reduce_passes_for_one_rank_and_fails_for_two(tmp_path):
    path = tmp_path / "skips.py"
    path.write_text(SKIPS_THE_ALL_REDUCE)
    (variant,) = load_file(str(path))
    try:
        verdicts = {}
        for ranks in (1, 2):
            search = Search(tiny_runner(), calls={"boundary": {"sliding": 2}}, out_dir=str(tmp_path / f"x{ranks}"),
                            seeds=(0,), ranks=ranks)
            verdicts[ranks] = search._try(variant, None, search.workloads("boundary"), ref_us=1.0)
            assert ("ranks" in search.fingerprint("boundary")) == (ranks > 1)  # a one-rank result is not reused
    finally:
        unload([variant])
    assert verdicts[1].gate_passed and verdicts[1].step_us > 0
    assert not verdicts[2].gate_passed and verdicts[2].step_us is None
    assert verdicts[2].failed_check.startswith("accuracy") and "world2" in verdicts[2].failed_check


def test_the_reference_and_locked_steps_are_timed_on_the_ranks_and_locked_with_them(tmp_path):
    opts = tiny_options(tmp_path, points=("boundary",), backends=("torch",), compile_baselines=(), seeds=(0,), tp=2)
    report = optimize(opts)
    across = report["across_ranks"]
    assert across["world"] == 2 and across["backend"] == "gloo"
    for build in ("reference", "locked"):
        timed = across["builds"][build]
        assert [r["rank"] for r in timed["per_rank"]] == [0, 1]
        assert timed["step_ms"] == max(r["median_ms"] for r in timed["per_rank"]) > 0
    assert across["speedup"] == across["builds"]["reference"]["step_ms"] / across["builds"]["locked"]["step_ms"]
    lock = yaml.safe_load((tmp_path / "lock.yaml").read_text())
    assert lock["end_to_end"]["across_ranks"] == {
        "ranks": 2, "backend": "gloo", "reference_us": across["builds"]["reference"]["step_ms"] * 1e3,
        "locked_us": across["builds"]["locked"]["step_ms"] * 1e3}
    assert "On 2 ranks at once (gloo" in (tmp_path / "report.md").read_text()
    assert optimize(opts)["across_ranks"] == across  # a resumed run reads them back


def test_tp_refuses_fewer_than_one_rank_and_agent_rounds(tmp_path):
    from workbench.agent.loop import AgentOptions

    with pytest.raises(ValueError, match="--tp must be at least 1"):
        optimize(tiny_options(tmp_path, tp=0))
    with pytest.raises(ValueError, match="agent rounds and --tp above 1"):
        optimize(tiny_options(tmp_path, tp=2, agent=AgentOptions("true")))
    assert not any(tmp_path.iterdir())  # refused before anything was written
