"""The op gate on activations captured from the trained beam-mini on held-out text (`workbench check
--preset beam-mini`): a planted fault that random inputs never show is rejected there."""

import pytest
from planted import TEXT_PLANTED, text_planted

from workbench.cli import build_parser
from workbench.commands.check import _capture
from workbench.commands.common import embedded_model
from workbench.gates import op_gate
from workbench.points import Workload
from workbench.registry import reference

pytestmark = pytest.mark.skipif(embedded_model() is None, reason="the embedded beam-mini is absent")


@pytest.mark.parametrize("name", sorted(TEXT_PLANTED))
def test_a_fault_only_real_activations_show_is_rejected_on_them(name):
    point, _, check, dtype = TEXT_PLANTED[name]
    variant = text_planted(name)
    fresh = op_gate(variant, [Workload(preset="beam-mini", dtype=dtype, batch=b) for b in (1, 3)], seeds=(0, 1, 2))
    assert fresh.passed, fresh.first_failure()  # random inputs miss it

    args = build_parser().parse_args(["check", point, "--preset", "beam-mini", "--dtype", dtype])
    captured = _capture(args, [point])[point]
    assert captured and all(c.label.startswith("text ") for c in captured)
    report = op_gate(variant, [], captured=captured)
    assert not report.passed and check in {c.name for c in report.failures}, report.first_failure()
    assert op_gate(reference(point), [], captured=captured).passed  # the reference passes the same calls
