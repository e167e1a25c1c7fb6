"""`workbench verify-cost`'s parts: routing that shares a fraction of experts (distinct ids, made once, no
work in the timed step), the step curve at batch 1, and the speed-up projection."""

import pytest
import torch

from workbench.verify_cost import (
    best_fixed_drafts,
    per_draft_acceptance,
    projected_speedup,
    shared_routing,
    verify_curve,
)


def test_shared_routing_keeps_a_fraction_of_the_first_tokens_experts_and_adds_no_work():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func)
            return func(*args, **(kwargs or {}))

    ids = torch.stack([torch.randperm(16)[:8] for _ in range(5)])
    weights = torch.rand(5, 8)
    routing = shared_routing(lambda x, wt, **kw: (ids, weights), 0.35, num_experts=16)
    out, w = routing(None, None)
    assert w is weights and out.shape == ids.shape and out.dtype == ids.dtype
    assert all(len(set(row.tolist())) == 8 for row in out)  # still 8 distinct experts a token
    first3 = set(out[0, :3].tolist())
    assert all(first3 <= set(row.tolist()) for row in out)
    assert len(set(out.reshape(-1).tolist())) > 8  # the rest of each token's own
    with Ops() as ops:  # once made, the step runs the route alone
        again, _ = routing(None, None)
    assert torch.equal(again, out) and ops.seen == []
    one = ids[:1]
    assert shared_routing(lambda x, wt, **kw: (one, weights[:1]), 0.35, num_experts=16)(None, None)[0] is one


def test_the_curve_and_the_projection():
    from beam_model import BeamForCausalLM

    model = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32)
    route = model.ops.route
    curve = verify_curve(model, [1, 3], context=32, overlap=0.5, budget_s=0.01)
    assert set(curve) == {1, 3} and all(r["median_us"] > 0 for r in curve.values())
    assert model.ops.route is route  # the rewritten routing is undone
    assert projected_speedup({1: 10.0, 4: 15.0}, 5.0, 3.0, 3) == 3.0 * 10.0 / 20.0


def test_the_drafts_that_pay_best_under_iid_acceptance():
    """p gives back the tokens a step it was fitted to; with a verify cost that grows fast, fewer drafts pay
    best; where no number of drafts beats plain decoding, the best of them says so (below 1)."""
    p = per_draft_acceptance(3.0, 3)
    assert abs(1 + p + p * p + p ** 3 - 3.0) < 1e-9 and per_draft_acceptance(1.0, 3) < 1e-9
    curve, draft = {1: 10.0, 2: 11.0, 3: 20.0, 4: 40.0}, 1.0
    best = best_fixed_drafts(curve, draft, 3.0, 3)
    assert best["drafts"] == 1 and abs(best["speedup"] - (1 + p) * 10.0 / 12.0) < 1e-9
    assert all(best["speedup"] >= (sum(p ** i for i in range(n + 1)) * 10.0 / (curve[n + 1] + draft))
               for n in (1, 2, 3))
    slow = best_fixed_drafts(curve, 100.0, 3.0, 3)  # a draft step of ten decode steps: every draft, and still < 1
    assert slow["drafts"] == 3 and abs(slow["speedup"] - 3.0 * 10.0 / 140.0) < 1e-9
    with pytest.raises(ValueError, match="outside 1 .. 4"):
        per_draft_acceptance(4.5, 3)


def test_the_command_writes_the_curve_the_draft_step_and_the_projection(tmp_path, capsys):
    import json

    from workbench.cli import main

    assert main(["verify-cost", "--tokens", "3", "--budget", "0.01", "--drafter-layers", "1", "--acceptance", "2",
                 "--out", str(tmp_path), "--json"]) == 0
    result = json.loads((tmp_path / "verify_cost.json").read_text())
    assert json.loads(capsys.readouterr().out) == result
    assert result["preset"] == "beam-tiny" and set(result["curves"]["random"]) == {"1", "2", "3"}
    assert result["draft_step_us"] > 0 and result["drafter_layers"] == 1
    curve = {int(n): c["median_us"] for n, c in result["curves"]["random"].items()}
    assert result["projected_speedup"]["random"]["2"] == projected_speedup(curve, result["draft_step_us"], 2.0, 2)
    assert result["projected_best_drafts"]["random"]["2"] == best_fixed_drafts(curve, result["draft_step_us"], 2.0, 2)
    # projected again from the file, timing nothing: the same figures
    out = tmp_path / "again"
    assert main(["verify-cost", "--from", str(tmp_path / "verify_cost.json"), "--acceptance", "2", "--out", str(out),
                 "--json"]) == 0
    again = json.loads((out / "projection.json").read_text())
    assert json.loads(capsys.readouterr().out) == again and again["from"] == str(tmp_path / "verify_cost.json")
    assert again["projected_speedup"] == result["projected_speedup"]
    assert again["projected_best_drafts"] == result["projected_best_drafts"]
    # as if drafting were free: every projection at least as high
    assert main(["verify-cost", "--from", str(tmp_path / "verify_cost.json"), "--acceptance", "2", "--draft-us", "0",
                 "--out", str(out), "--json"]) == 0
    free = json.loads((out / "projection.json").read_text())
    capsys.readouterr()
    assert free["draft_step_us"] == 0 and free["projected_best_drafts"]["random"]["2"] == best_fixed_drafts(curve, 0.0,
                                                                                                             2.0, 2)
    assert main(["verify-cost", "--draft-us", "0"]) == 2
    assert "give --from FILE too" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    assert main(["verify-cost", "--from", str(tmp_path / "bad.json")]) == 2
    assert "not a verify_cost.json" in " ".join(capsys.readouterr().err.split())
