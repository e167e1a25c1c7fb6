"""The draft-b1 target: a DFlash drafter's block step for the model, its points bound with the model's,
so the profiler sees them and `optimize` searches and locks them (beam-tiny, CPU)."""

import pytest
import torch
import yaml
from harness_helpers import tiny_options

from workbench.targets import StepRunner, for_device, get_target


@pytest.fixture(scope="module")
def runner():
    from beam_model import BeamForCausalLM

    model = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32)
    return StepRunner(model, for_device(get_target("draft-b1"), model.device))


def test_the_step_proposes_a_block_and_every_point_it_calls_is_the_models(runner):
    from workbench.profiler import profile_step

    target, layers = runner.target, runner.drafter.config.num_hidden_layers
    assert runner().shape == (target.batch, target.tokens_per_seq - 1)
    assert runner.drafter.ops is runner.model.ops
    profile = profile_step(runner, workload_for=lambda kind: target.workload("beam-tiny", "fp32", kind))
    calls = {p.point: p.calls_by_kind for p in profile.points}
    assert calls == {"qkvg_proj": {"model": layers}, "qk_prep": {"model": layers}, "attn_out": {"model": layers},
                     "draft_attention": {"model": layers}, "boundary": {"model": 2 * layers},
                     "dense_mlp": {"model": layers}, "head": {"model": 1}}
    assert target.workload("beam-tiny", "fp32", "model").tokens == target.batch * target.tokens_per_seq
    runner.rebind({"qkvg_proj": "packed"})
    assert runner.drafter.ops is runner.model.ops and runner.drafter.ops.selection["qkvg_proj"] == "packed"
    # as the engine's verify + draft graph runs the drafter's kernels: none reads the target's KV cache, so PDL
    # stays on (draft_attention reads the drafter's store, only after its wait: its contract)
    runner.rebind({"boundary": "triton"}, {"boundary": {"num_warps": 4, "pdl": True}})
    assert runner.drafter.ops.configs == {"boundary": {"num_warps": 4, "pdl": True}}
    runner.rebind(None)


def test_optimize_locks_the_drafters_step(tmp_path):
    from workbench.optimize import optimize

    report = optimize(tiny_options(tmp_path, target="draft-b1", points=("boundary",), backends=("torch",),
                                   compile_baselines=(), seeds=(0,)))
    lock = yaml.safe_load((tmp_path / "lock.yaml").read_text())
    assert lock["target"] == "draft-b1" and report["target"] == "draft-b1"
    assert report["step"]["tokens_per_seq"] == 16
    (boundary,) = [p for p in report["points"] if p["point"] == "boundary"]
    assert boundary["reference_ms"] > 0 and boundary["locked_step_ms"] > 0  # searched, and run in the locked step
    assert lock["end_to_end"]["locked_us"] > 0 and lock["end_to_end"]["model_gate"]["passed"]
    # the drafter's step never calls the target's routing or experts: the lock says so, and their code is free
    assert lock["points"]["experts"]["calls"] == lock["points"]["route"]["calls"] == 0
    assert lock["points"]["boundary"]["calls"] > 0


@pytest.mark.gpu
def test_the_graphed_verify_and_draft_steps_replay_what_they_run_eagerly():
    from beam_model import BeamForCausalLM

    model = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32, device="cuda")
    for name in ("verify-b8", "draft-b1"):
        runner = StepRunner(model, get_target(name))
        assert runner.graph is not None, name
        replayed = runner().clone()
        with torch.inference_mode():
            assert torch.equal(replayed, runner._eager()), name
