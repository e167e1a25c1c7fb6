"""The rank gate: `boundary` variants on 2 or 3 gloo ranks of the CPU, each rank its own partial sum.
The reference passes; each planted fault of tensor parallelism, right on one process, is rejected by
the check it breaks."""

import functools

import pytest
from planted import RANK_PLANTED, rank_planted

from workbench.points import Workload
from workbench.rank_gate import rank_gate, registered

WORKLOADS = [Workload(preset="beam-tiny", dtype="bf16", batch=3)]


def test_the_reference_passes_on_two_ranks():
    report = rank_gate(registered("boundary", "torch"), WORKLOADS + [Workload(preset="beam-tiny", dtype="fp32")])
    assert report.passed, report.first_failure()
    names = {c.name for c in report.checks}
    assert {"runs", "accuracy", "ranks agree", "inputs unchanged"} <= names
    assert len({c.case for c in report.checks}) == 4  # two workloads x two seeds


@pytest.mark.parametrize("name", sorted(RANK_PLANTED))
def test_a_planted_fault_of_tensor_parallelism_is_rejected(name):
    _, check, world = RANK_PLANTED[name]
    report = rank_gate(functools.partial(rank_planted, name), WORKLOADS, world=world, seeds=(0,), timeout_s=60)
    assert not report.passed
    assert check in {c.name for c in report.failures}, [(c.name, c.detail) for c in report.failures]


def test_a_point_that_never_communicates_is_refused():
    with pytest.raises(ValueError, match="does not all-reduce"):
        rank_gate(registered("attn_out", "torch"), WORKLOADS)


def test_check_gates_boundary_variants_on_ranks():
    from workbench.cli import build_parser
    from workbench.commands.check import gate_all

    args = build_parser().parse_args(["check", "boundary:torch", "--seeds", "1", "--no-capture",
                                      "--prefill", "0", "0", "0"])
    (row,) = gate_all(args)
    assert row["status"] == "pass" and any(c.name == "ranks agree" for c in row["report"].checks)
    args.ranks = 1
    (row,) = gate_all(args)
    assert not any(c.name == "ranks agree" for c in row["report"].checks)
