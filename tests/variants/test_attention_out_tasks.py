"""`attention_out:triton_tasks`: attention and merge-gate tasks from a ticket queue, then each program's
own o_proj rows, in one persistent launch (Triton interpreter at beam-tiny shapes; the TP8 rank's shapes,
PDL and the dependency waits on the GPU). The planted faults are the real kernel with one thing taken
out, so the gates are shown to reject what goes wrong in this design: a queue left for the next launch
unreset, a program's second o_proj task multiplying its first one's weight tile, an o_proj task that
reads its activations without waiting for them (only a GPU runs tasks at once)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from workbench import registry
from workbench.gates import op_gate
from workbench.points import Workload, spec
from workbench.registry import Variant

pytestmark = pytest.mark.skipif(registry.backend_available("triton")[0] is False, reason="needs triton")

B1 = Workload(batch=1, context=1000)
B2 = Workload(batch=2, context=300)


def _variant():
    return registry.get("attention_out", "triton_tasks")


def _task_calls(monkeypatch) -> list:
    from workbench.variants.kernels import attention_tasks

    calls, run = [], attention_tasks.decode_tasks
    monkeypatch.setattr(attention_tasks, "decode_tasks", lambda *a, **k: calls.append(k["tasks_cfg"]) or run(*a, **k))
    return calls


def test_the_op_gate_passes_through_the_task_kernel_at_every_config(monkeypatch):
    """Batch 1 decode (and batch 2 where a config takes several rows) runs the one launch; sliding and
    full layers; the fallback's prefill and wider batches pass too."""
    calls = _task_calls(monkeypatch)
    prefill = Workload(batch=2, tokens_per_seq=20, context=100)
    workloads = [B1.with_(layer=k) for k in ("sliding", "full")] + [B2, prefill]
    for config in _variant().configs:
        report = op_gate(_variant(), workloads, seeds=(0,), config=config)
        assert report.passed, (config, report.failures)
    assert len(calls) >= 2 * len(_variant().configs)


def test_the_queue_is_left_zeroed_and_calls_repeat_bit_for_bit():
    from workbench.variants.kernels.arrivals import COUNTERS

    call = spec("attention_out").make_inputs(B2, "cpu", 3)
    fn = _variant().at(_variant().configs[-1])  # two decode rows a launch
    y = fn(*call.args, **call.kwargs)
    assert not COUNTERS[(torch.device("cpu"), "attention_out_tasks")].any()
    for _ in range(2):
        assert torch.equal(y, fn(*call.args, **call.kwargs))


def test_one_program_or_one_per_task_gives_the_same_bits(monkeypatch):
    """The grid only says how many programs share the queue: the first takes every ticket, or each
    takes one and the rest find the queue empty."""
    from workbench.variants.kernels import task_queue

    call = spec("attention_out").make_inputs(B1.with_(layer="full"), "cpu", 1)
    fn = _variant().at(_variant().configs[0])
    results = []
    for grid in (lambda device, per_sm, tasks: 1, lambda device, per_sm, tasks: tasks):
        monkeypatch.setattr(task_queue, "programs", grid)
        results.append(fn(*call.args, **call.kwargs))
    assert torch.equal(*results)


def test_prefill_and_rows_past_max_tokens_take_three_launches(monkeypatch):
    calls = _task_calls(monkeypatch)
    report = op_gate(_variant(), [B2, Workload(batch=2, tokens_per_seq=20, context=100)], seeds=(0,),
                     config=_variant().configs[0])
    assert report.passed, report.failures
    assert calls == []


# ---- planted faults: the real kernel with one thing taken out ---------------------------------------

KERNEL = Path(__file__).resolve().parents[2] / "workbench/variants/kernels/attention_tasks.py"
OWNER = '"attention_out_tasks"'

FAULTS = {  # the one line of the kernel holding the marker, and what it becomes (None: `pass`)
    # no program counts itself out: the ticket stays past the tasks, the next launch runs none of them
    "queue_never_reset": ("queue.finish(", None),
    # the next o_proj task's weight tile is never kept: a program's second task multiplies its first's
    "stale_weight_tile": ("        token, rows, w = _o_proj_rows(", ("rows, w =", "rows, _ =")),
    # o_proj tasks read the gated activations as soon as their weights are in
    "no_dependency_wait": ("queue.wait_for(gated_done", None),
}


def planted_kernel(fault: str, tmp_path: Path) -> Variant:
    """attention_out:triton_tasks (its config of several decode rows) on a copy of its kernel with
    `fault` planted, and its own counters."""
    marker, edit = FAULTS[fault]
    lines = KERNEL.read_text().splitlines(keepends=True)
    (at,) = [i for i, line in enumerate(lines) if marker in line]  # the kernel changed if this fails: re-plant
    line = lines[at]
    lines[at] = line[:len(line) - len(line.lstrip())] + "pass\n" if edit is None else line.replace(*edit)
    source = "".join(lines)
    assert source.count(OWNER) == 1
    source = source.replace(OWNER, f'"planted_{fault}"')
    path = tmp_path / f"planted_attention_tasks_{fault}.py"
    path.write_text(source)
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[path.stem] = module  # triton resolves a kernel's globals through its module
    module_spec.loader.exec_module(module)
    config = next(c for c in _variant().configs if c["max_tokens"] >= 2)

    def attention_out(q, cache, meta, g, w, *, window, scale):
        return module.decode_tasks(q, cache, meta, g, w["gate_bias"], w["o_proj"], window=window, scale=scale,
                                   attention_cfg=dict(config["attention"]), tasks_cfg=config["tasks"], pdl=False)
    return Variant("attention_out", f"planted_{fault}", "triton", attention_out)


@pytest.mark.parametrize("fault", ["queue_never_reset", "stale_weight_tile"])
def test_the_op_gate_rejects_a_planted_queue_fault(fault, tmp_path, monkeypatch):
    """Two programs, so that each runs two of beam-tiny's four o_proj tasks (as some do of the TP8
    rank's 320 tasks of 16 rows on 264 programs). One decode row: a queue left unreset for a launch of
    another shape leaves its o_proj tasks waiting on counters nobody counts up (a hang, not a verdict)."""
    from workbench.variants.kernels import task_queue

    monkeypatch.setattr(task_queue, "programs", lambda device, per_sm, tasks: 2)
    report = op_gate(planted_kernel(fault, tmp_path), [B1], seeds=(0,))
    assert not report.passed
    assert {c.name for c in report.checks if not c.passed} & {"accuracy", "finite", "fresh_inputs", "deterministic"}


def test_without_its_wait_the_kernel_still_passes_where_tasks_run_one_at_a_time(tmp_path):
    """Under the interpreter a missing wait cannot show (the first program runs every queued task before
    any program reaches its o_proj tasks); the GPU test below is where the gate must reject it."""
    assert op_gate(planted_kernel("no_dependency_wait", tmp_path), [B1, B2], seeds=(0,)).passed


# ---- on the GPU: the TP8 rank's shapes, PDL, tasks at once ----------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("layer, context", [("sliding", 4096), ("full", 4096), ("full", 32768)])
def test_gpu_tp8_gate_and_repeatable(layer, context):
    wl = Workload(preset="beam-501b-tp8", batch=1, context=context, layer=layer)
    call = spec("attention_out").make_inputs(wl, "cuda", 0)
    for config in _variant().configs + [dict(c, pdl=True) for c in _variant().configs]:
        assert op_gate(_variant(), [wl], device="cuda", seeds=(0,), config=config).passed, config
        fn = _variant().at(config)
        y = fn(*call.args, **call.kwargs)
        for _ in range(3):  # the queue resets itself
            assert torch.equal(y, fn(*call.args, **call.kwargs)), config


@pytest.mark.gpu
def test_gpu_the_op_gate_rejects_a_task_that_does_not_wait(tmp_path):
    """At the TP8 rank's shapes every o_proj task but those of the attention's programs starts while
    attention runs: without the wait they multiply activations not written yet."""
    wl = Workload(preset="beam-501b-tp8", batch=1, context=4096)
    report = op_gate(planted_kernel("no_dependency_wait", tmp_path), [wl], device="cuda", seeds=(0, 1))
    assert not report.passed
