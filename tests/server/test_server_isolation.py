"""Failures kept to the request that causes them, in-process: a model step that fails with several
sequences fails only the ones that fail alone; seeds outside what torch takes are refused up front.

beam-tiny in FP32 on the CPU.
"""

import pytest
import torch

from beam_model.model import BeamForCausalLM
from beam_model.tokenizer import ByteTokenizer
from server.engine import Engine, SamplingParams
from server.engine.testing import ScriptedLogits

TOK = ByteTokenizer()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add overhead
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model():
    return BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32, seed=0)


def run_all(eng, first=()) -> dict[str, list]:
    """Each request's outputs, stepping until none is left (`first`: outputs already taken)."""
    outs: dict[str, list] = {}
    pending = list(first)
    while pending or eng.has_unfinished():
        for o in pending:
            outs.setdefault(o.request_id, []).append(o)
        pending = eng.step() if eng.has_unfinished() else []
    return outs


# ------------------------------------------------------------------ the engine

def test_a_request_failing_in_a_shared_step_fails_alone(model):
    hook = ScriptedLogits(TOK, [{"when": "boom", "reply": "abc", "fail_at": 2}, {"when": "hello", "reply": "hi there"}])
    eng = Engine(model, TOK, num_pages=16, logits_hook=hook)
    eng.add_request("bad", TOK.encode("boom"), SamplingParams(max_tokens=10))
    eng.add_request("good", TOK.encode("hello"), SamplingParams(max_tokens=30))
    first = eng.step()
    assert eng.last_step[1] == 2  # both run in every step until 'bad' fails
    outs = run_all(eng, first)
    bad, good = outs["bad"], outs["good"]
    assert bad[-1].finish_reason == "error" and "scripted failure" in bad[-1].error
    assert good[-1].finish_reason == "stop" and good[-1].error is None
    assert "".join(o.text for o in good) == "hi there"
    assert eng.stats()["pages_used"] == {"full_attention": 0, "sliding_attention": 0}


def test_a_seeded_request_beside_a_failing_one_draws_as_if_alone(model):
    # The runner fails after drawing (the seeded generator has moved): the re-run must draw again from
    # where the step started, so the seeded request's tokens are those it gets alone.
    p = SamplingParams(max_tokens=8, temperature=1.0, seed=1234, ignore_eos=True)
    alone = Engine(model, TOK, num_pages=16).generate([TOK.encode("a seeded prompt")], p)[0]
    eng = Engine(model, TOK, num_pages=16)
    real = eng.runner.run

    def run(seqs, counts):
        out = real(seqs, counts)
        if any(s.request_id == "bad" for s in seqs):
            raise RuntimeError("request 'bad' breaks every step it is in")
        return out

    eng.runner.run = run
    eng.add_request("bad", TOK.encode("another prompt"), SamplingParams(max_tokens=8, temperature=1.0, seed=7))
    eng.add_request("good", TOK.encode("a seeded prompt"), p)
    outs = run_all(eng)
    assert [o.finish_reason for o in outs["bad"]] == ["error"] and "breaks every step" in outs["bad"][0].error
    assert [t for o in outs["good"] for t in o.token_ids] == alone
    assert outs["good"][-1].finish_reason == "length"


def test_sampling_params_take_the_seeds_torch_takes():
    for seed in (-2**63, -1, 0, 2**63 - 1, 2**64 - 1):
        SamplingParams(seed=seed)
    for seed in (-2**63 - 1, 2**64, 10**30):
        with pytest.raises(ValueError, match="seed") as e:
            SamplingParams(seed=seed)
        assert e.value.param == "seed"
