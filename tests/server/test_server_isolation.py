"""Failures kept to the request that causes them, in-process: a model step that fails with several
sequences fails only the ones that fail alone; seeds outside what torch takes are refused up front;
every 500 is counted once in /metrics; a client leaving mid-body is no server error.

beam-tiny in FP32 on the CPU, the app driven over ASGI without a socket.
"""

import asyncio
import json
import logging

import pytest
from starlette.testclient import TestClient

from beam_model.tokenizer import ByteTokenizer
from server.api.app import build_app
from server.api.server import make_state
from server.engine import Engine, SamplingParams
from server.engine.testing import ScriptedLogits

TOK = ByteTokenizer()






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


# ------------------------------------------------------------------ the HTTP app

@pytest.fixture(scope="module")
def state(model):
    return make_state(Engine(model, TOK, num_pages=16), TOK, served_model_name="beam-tiny")


def rejected(state) -> dict[str, float]:
    return {s.labels["status"]: s.value for m in state.metrics.rejected.collect() for s in m.samples
            if s.name.endswith("_total")}


def test_every_500_is_counted_once(state, monkeypatch, caplog):
    def broken(text):
        raise RuntimeError("tokenizer bug")

    monkeypatch.setattr(state.tokenizer, "encode", broken)  # raised in the handler, answered outside it
    client = TestClient(build_app(state), raise_server_exceptions=False)
    before = rejected(state).get("500", 0)
    r = client.post("/v1/completions", json={"model": "beam-tiny", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert rejected(state).get("500", 0) - before == 1
    assert any("unhandled error" in rec.message for rec in caplog.records)  # a real bug keeps its traceback


def test_a_client_leaving_mid_body_is_no_server_error(state, caplog):
    app = build_app(state)
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000),
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000")]}
    messages = [{"type": "http.request", "body": json.dumps({"model": "beam-tiny"})[:9].encode(), "more_body": True},
                {"type": "http.disconnect"}]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    before = rejected(state).get("500", 0)
    with caplog.at_level(logging.DEBUG):
        asyncio.run(app(scope, receive, send))  # raises nothing: nothing is left for the server to log
    assert rejected(state).get("500", 0) == before
    assert not [rec for rec in caplog.records if rec.levelno >= logging.WARNING or rec.exc_info]
    assert all(m.get("status", 0) != 500 for m in sent)
