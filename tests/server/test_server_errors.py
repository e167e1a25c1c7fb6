"""Every error the server reports, with its status and OpenAI-shaped body; the API key; 503 when
overloaded; and a graceful shutdown that lets the stream in flight finish.

A real server with tight limits: at most 2 running + 1 waiting request (a 4th in flight is a 503).
"""

import contextlib
import json
import signal
import threading

import httpx
import openai
import pytest

from tests.server_harness import API_KEY, MODEL, WEATHER, ServerProcess


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-num-seqs", "2", "--max-queue-len", "1")
    yield srv
    srv.stop()


def post(server, path, body=None, *, content=None, headers=None):
    h = server.headers if headers is None else headers
    return httpx.post(server.url + path, json=body, content=content, headers=h, timeout=30)


def assert_error(r, status, *, type="invalid_request_error", param=None, code=None, message=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == type
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    if message is not None:
        assert message in err["message"]
    return err


def chat_body(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


# ------------------------------------------------------------------ routes, JSON, models

def test_unknown_routes_and_methods(server):
    assert_error(httpx.get(server.url + "/v1/nope", headers=server.headers), 404, code="not_found")
    assert_error(post(server, "/v1/chat/completion", chat_body()), 404, code="not_found")
    assert_error(httpx.get(server.url + "/v1/chat/completions", headers=server.headers), 405)


def post_raw(server, path, content: bytes, content_type: str | None = "application/json"):
    headers = {**server.headers, **({"Content-Type": content_type} if content_type else {})}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=30)


def test_bad_json(server):
    assert_error(post_raw(server, "/v1/chat/completions", b"{not json"), 400, message="not valid JSON")
    assert_error(post_raw(server, "/v1/completions", b"[1, 2]"), 400, message="JSON object")
    huge = b'{"model": "beam-tiny", "prompt": "x", "seed": ' + b"1" * 5000 + b"}"  # past Python's digit limit
    assert_error(post_raw(server, "/v1/completions", huge), 400, message="not valid JSON")


def test_deeply_nested_json_is_400(server):
    # '[' * 100000 overflows the parser's recursion; 200 levels parse but later code recurses through them
    assert_error(post_raw(server, "/v1/completions", b"[" * 100_000), 400, message="nested")
    deep = {"model": MODEL, "prompt": "x", "metadata": {}}
    node = deep["metadata"]
    for _ in range(200):
        node["a"] = {}
        node = node["a"]
    assert_error(post(server, "/v1/completions", deep), 400, param="metadata", message="nested")
    assert post(server, "/v1/chat/completions", chat_body()).status_code == 200


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": MODEL, "prompt": "a\ud800b", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "ab", "stop": ["\udc00"], "max_tokens": 2}, "stop"),
    ("/v1/chat/completions", chat_body(stop="x\ud800"), "stop"),
    ("/v1/chat/completions", chat_body(messages=[{"role": "user", "content": "a\ud800b"}]), "messages"),
    ("/v1/chat/completions", chat_body(model="beam\ud800"), "model"),
])
def test_lone_surrogates_are_400_naming_the_param(server, path, body, param):
    # json.dumps escapes the lone surrogate as \ud800: valid JSON syntax, but not Unicode text
    assert_error(post_raw(server, path, json.dumps(body).encode()), 400, param=param, message="surrogate")


def test_a_json_body_needs_a_json_content_type(server):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    for content_type in ("text/plain", None, "application/x-www-form-urlencoded", "multipart/form-data"):
        assert_error(post_raw(server, "/v1/completions", body, content_type), 400, message="application/json")
    for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON",
                         "application/vnd.api+json"):
        assert post_raw(server, "/v1/completions", body, content_type).status_code == 200, content_type


def test_seed_out_of_range_is_400_and_its_extremes_work(server):
    # torch.Generator.manual_seed takes [-2**63, 2**64 - 1]; outside it, the model step itself fails
    for seed in (2**64, -2**63 - 1, 10**30):
        assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "seed": seed,
                                                      "temperature": 1.0}), 400, param="seed", message="seed")
    for seed in (2**63 - 1, 2**64 - 1, -2**63, 0):
        r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "seed": seed,
                                             "temperature": 1.0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, (seed, r.text)


def test_unknown_model(server):
    for path, body in (("/v1/chat/completions", chat_body(model="gpt-17")),
                       ("/v1/completions", {"model": "gpt-17", "prompt": "x"})):
        assert_error(post(server, path, body), 404, param="model", code="model_not_found")
    assert_error(httpx.get(server.url + "/v1/models/gpt-17", headers=server.headers), 404, code="model_not_found")
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "x"}])


@pytest.mark.parametrize("extra, param", [
    ({"temperature": 3}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -5}, "top_k"),
    ({"n": 2}, "n"), ({"max_tokens": 0}, "max_tokens"), ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"seed": "x"}, "seed"), ({"stop": [""]}, "stop"), ({"stop": 5}, "stop"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"presence_penalty": 1.0}, "presence_penalty"), ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": []}, "messages"), ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"tools": [{"type": "function"}]}, "tools[0]"), ({"tools": "all"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"), ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"model": None}, "model"), ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format"),  # the grammar engine refuses it
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"response_format": "json"}, "response_format"), ({"thinking_token_budget": -1}, "thinking_token_budget"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_invalid_chat_requests(server, extra, param):
    assert_error(post(server, "/v1/chat/completions", chat_body(**extra)), 400, param=param)


def test_a_schema_the_grammar_engine_refuses_is_named_in_one_line(server):
    """The engine's reason, without the grammar text the server wrote around the client's schema."""
    body = chat_body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}})
    r = post(server, "/v1/chat/completions", body)
    assert_error(r, 400, param="response_format")
    message = r.json()["error"]["message"]
    assert "frob" in message and "\n" not in message and "<|think|>" not in message, message


@pytest.mark.parametrize("extra, param", [
    ({"prompt": ""}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": {"x": 1}}, "prompt"),
    ({"prompt": [1, 99999]}, "prompt"), ({"echo": True}, "echo"), ({"best_of": 3}, "best_of"),
    ({"logprobs": 9}, "logprobs"), ({"suffix": "z"}, "suffix"),
])
def test_invalid_completion_requests(server, extra, param):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, **extra}
    assert_error(post(server, "/v1/completions", body), 400, param=param)


def test_prompt_longer_than_the_context(server):
    long = "x" * 5000  # beam-tiny's context is 4096 tokens
    err = assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": long}), 400,
                       param="prompt", code="context_length_exceeded")
    assert "4096" in err["message"]
    assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "x" * 4000, "max_tokens": 200}), 400,
                 code="context_length_exceeded")
    assert_error(post(server, "/v1/chat/completions", chat_body(messages=[{"role": "user", "content": long}])),
                 400, param="messages", code="context_length_exceeded")
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=MODEL, prompt=long)


# ------------------------------------------------------------------ API key

def test_api_key_required_on_the_api_only(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        assert_error(post(server, "/v1/chat/completions", chat_body(), headers=headers), 401, code="invalid_api_key")
    assert_error(httpx.get(server.url + "/v1/models"), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert post(server, "/v1/chat/completions", chat_body()).status_code == 200


# ------------------------------------------------------------------ 503 and shutdown

def _long_stream(server, started: threading.Event, result: dict, max_tokens=400):
    body = {"model": MODEL, "prompt": "Go on and on", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers, timeout=60) as r:
        result["status"] = r.status_code
        lines = []
        for line in r.iter_lines():
            started.set()
            lines.append(line)
        result["lines"] = [x for x in lines if x.startswith("data: ")]


def test_overloaded_is_503(server):
    body = {"model": MODEL, "prompt": "Go on", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with contextlib.ExitStack() as stack, httpx.Client(headers=server.headers, timeout=60) as http:
        for _ in range(3):  # 2 running + 1 waiting: the limit (headers come back before any token)
            r = stack.enter_context(http.stream("POST", server.url + "/v1/completions", json=body))
            assert r.status_code == 200
        assert server.engine_stats()["in_flight"] == 3
        assert_error(post(server, "/v1/chat/completions", chat_body()), 503, type="server_error", code="overloaded")
        with pytest.raises(openai.InternalServerError):
            server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    # leaving the block closed the three streams: aborted, pages back
    assert server.wait_idle()["pages_used"] == {"full_attention": 0, "sliding_attention": 0}
    assert post(server, "/v1/chat/completions", chat_body()).status_code == 200


def test_graceful_shutdown_finishes_the_stream_in_flight(server):
    started, result = threading.Event(), {}
    t = threading.Thread(target=_long_stream, args=(server, started, result, 60), daemon=True)
    t.start()
    assert started.wait(30)
    server.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert result["status"] == 200 and result["lines"][-1] == "data: [DONE]"
    assert '"finish_reason": "length"' in "".join(result["lines"])
    assert server.proc.wait(30) in (0, -signal.SIGTERM)


def test_serve_refuses_a_lock_it_cannot_load(tmp_path, capsys):
    from workbench.cli import main

    assert main(["serve", "--lock", str(tmp_path / "missing.yaml")]) == 2
    assert "no lock file" in capsys.readouterr().err
