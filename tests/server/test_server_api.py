"""The OpenAI-compatible server end to end: a real `workbench serve` process (beam-tiny, CPU) driven
by the official `openai` client. Chat and completions, streamed and not, usage, stop strings,
seeds, logprobs, prefix-cache accounting, reasoning and tool calls (via the scripted test model,
see tests/server_harness.py), and a disconnect that gives the pages back at once.
"""

import json
import signal
import time

import httpx
import openai
import pytest

from beam_model.chat_template import render_chat
from beam_model.tokenizer import ByteTokenizer
from tests.server_harness import MODEL, TIME, WEATHER, ServerProcess, metric_sum

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess()
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM), srv.log()  # uvicorn re-raises SIGTERM after a clean shutdown


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat(client, content, **kw):
    kw.setdefault("max_tokens", 16)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def stream_chat(client, content, **kw):
    kw.setdefault("max_tokens", 16)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                 stream=True, **kw))
    return chunks


# ------------------------------------------------------------------ basics

def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_chat_non_streamed_and_streamed_agree(client):
    full = chat(client, "Hello there", temperature=0, max_tokens=12)
    choice = full.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.role == "assistant"
    u = full.usage
    assert u.prompt_tokens == len(TOK.encode(render_chat([{"role": "user", "content": "Hello there"}])))
    assert 1 <= u.completion_tokens <= 12 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0
    chunks = stream_chat(client, "Hello there", temperature=0, max_tokens=12,
                         stream_options={"include_usage": True})
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (choice.message.content or "")
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == u.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_content_parts_and_max_completion_tokens(client):
    a = chat(client, "same words", temperature=0, max_tokens=8)
    b = client.chat.completions.create(model=MODEL, temperature=0, max_completion_tokens=8,
                                       response_format={"type": "text"}, messages=[
        {"role": "user", "content": [{"type": "text", "text": "same "}, {"type": "text", "text": "words"}]}])
    assert a.choices[0].message.content == b.choices[0].message.content
    assert b.usage.completion_tokens <= 8


def test_a_developer_message_is_read_as_a_system_message(client):
    def ask(role):
        return client.chat.completions.create(model=MODEL, temperature=0, max_tokens=8, messages=[
            {"role": role, "content": "Be brief."}, {"role": "user", "content": "same words"}])

    developer, system = ask("developer"), ask("system")
    assert developer.choices[0].message.content == system.choices[0].message.content
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens


def test_length_finish_and_stop_strings(client):
    base = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert base.choices[0].finish_reason == "length" and base.usage.completion_tokens == 24
    text = base.choices[0].text
    stop = text[6:9]
    cut = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0,
                                    stop=[stop, "never-there"], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]
    streamed = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0,
                                         stop=stop, stream=True, extra_body={"ignore_eos": True})
    pieces = list(streamed)
    assert "".join(p.choices[0].text for p in pieces) == cut.choices[0].text
    assert pieces[-1].choices[0].finish_reason == "stop"


def test_seed_reproducibility(client):
    kw = dict(temperature=1.0, top_p=0.95, max_tokens=24, extra_body={"ignore_eos": True})
    a = chat(client, "Pick a word", seed=42, **kw).choices[0].message.content
    b = chat(client, "Pick a word", seed=42, **kw).choices[0].message.content
    c = chat(client, "Pick a word", seed=43, **kw).choices[0].message.content
    assert a == b and a != c


def test_logprobs(client):
    r = chat(client, "Logprobs please", temperature=0, max_tokens=6, logprobs=True, top_logprobs=3,
             extra_body={"ignore_eos": True})
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens == 6
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)  # greedy picks the top token
    c = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 4 and all(len(t) <= 2 for t in lp.top_logprobs)


def test_completions_token_ids_and_prefix_cache_usage(client):
    prompt = "The quick brown fox jumps over the lazy dog. " * 7  # 315 tokens: 4 full pages
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 256
    assert again.choices[0].text == first.choices[0].text
    ids = client.completions.create(model=MODEL, prompt=TOK.encode(prompt), max_tokens=4, temperature=0)
    assert ids.choices[0].text == first.choices[0].text and ids.usage.prompt_tokens == len(prompt)


# ------------------------------------------------------------------ reasoning and tools

def test_reasoning_content_and_round_trip(client):
    r = chat(client, "SCRIPT_REASON: what is it?", max_tokens=64)
    m = r.choices[0].message
    assert (m.reasoning_content, m.content, r.choices[0].finish_reason) == ("I think deeply.", "The answer is 42.",
                                                                             "stop")
    assert m.reasoning == "I think deeply."
    chunks = stream_chat(client, "SCRIPT_REASON: what is it?", max_tokens=64)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "I think deeply."
    assert "".join(d.content or "" for d in deltas) == "The answer is 42."
    first_reasoning = next(i for i, d in enumerate(deltas) if getattr(d, "reasoning_content", None))
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert first_reasoning < first_content
    # The client sends the reasoning back; the template re-renders it (the script checks for it).
    messages = [{"role": "user", "content": "SCRIPT_REASON: what is it?"},
                {"role": "assistant", "content": m.content, "reasoning_content": m.reasoning_content},
                {"role": "user", "content": "and then?"}]
    r2 = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32)
    assert r2.choices[0].message.content == "ROUNDTRIP_OK"
    assert r2.usage.prompt_tokens == len(TOK.encode(render_chat(messages)))


def test_tool_call_auto(client):
    r = chat(client, "SCRIPT_TOOL weather in Paris?", tools=[WEATHER, TIME], max_tokens=128)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert c.message.reasoning_content == "Need weather."
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_tool_call_streamed_name_then_arguments(client):
    chunks = stream_chat(client, "SCRIPT_TOOL weather in Paris?", tools=[WEATHER], max_tokens=128)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "get_weather" and calls[0].id and not calls[0].function.arguments
    assert json.loads("".join(tc.function.arguments or "" for tc in calls[1:])) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_forced_tool_calls(client):
    named = chat(client, "SCRIPT_FORCED_NAMED", tools=[WEATHER, TIME], max_tokens=64,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}
    required = chat(client, "SCRIPT_FORCED_REQ", tools=[WEATHER, TIME], tool_choice="required", max_tokens=64)
    (call,) = required.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {"tz": "UTC"}
    assert required.choices[0].finish_reason == "tool_calls"
    # Random weights under the grammar: a turn that follows the template, cut by max_tokens
    junk = chat(client, "no script here", tools=[WEATHER], tool_choice="required", max_tokens=24)
    assert junk.choices[0].finish_reason in ("length", "tool_calls")


def test_malformed_or_refused_tool_calls_are_content(client):
    bad = chat(client, "SCRIPT_BAD_TOOL", max_tokens=64)  # no tools offered: decoded without a grammar
    m = bad.choices[0].message
    assert not m.tool_calls and m.content == '<|tool_call|>{"name": broken<|/tool_call|>'
    assert bad.choices[0].finish_reason == "stop"
    none = chat(client, "SCRIPT_TOOL weather?", tools=[WEATHER], tool_choice="none", max_tokens=128)
    m = none.choices[0].message
    assert not m.tool_calls and '"get_weather"' in m.content and none.choices[0].finish_reason == "stop"


# ------------------------------------------------------------------ errors mid-stream, disconnects

def test_engine_error_after_the_stream_started(server, client):
    with pytest.raises(openai.APIError, match="scripted failure"):
        for _ in stream_chat(client, "SCRIPT_FAIL", max_tokens=32):
            pass
    body = {"model": MODEL, "messages": [{"role": "user", "content": "SCRIPT_FAIL"}], "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=server.headers) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "server_error" and "scripted failure" in err["message"]
    assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False}, headers=server.headers)
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
    assert server.wait_idle()["pages_used"] == {"full_attention": 0, "sliding_attention": 0}


def test_client_disconnect_aborts_and_frees_pages(server):
    before = server.metrics()
    body = {"model": MODEL, "prompt": "Tell me a long story. " * 10, "max_tokens": 3000, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(g.startswith("data: ") for g in got)
        assert server.engine_stats()["running"] == 1
        t0 = time.monotonic()
    stats = server.wait_idle(timeout=5)
    assert time.monotonic() - t0 < 5
    assert stats["running"] == 0 and stats["pages_used"] == {"full_attention": 0, "sliding_attention": 0}
    after = server.metrics()
    key = "beam_requests_total{endpoint=completions,finish_reason=abort}"
    assert after.get(key, 0) - before.get(key, 0) == 1
    assert after["beam_kv_pages_used{group=full_attention}"] == 0
    # it stopped long before 3000 tokens
    assert metric_sum(after, "beam_generation_tokens_total") - metric_sum(before, "beam_generation_tokens_total") < 2000


def test_non_streamed_client_disconnect_aborts(server):
    before = server.metrics()
    body = {"model": MODEL, "prompt": "Keep going", "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(server.url + "/v1/completions", json=body, headers=server.headers,
                   timeout=httpx.Timeout(10, read=1.0))
    stats = server.wait_idle(timeout=5)
    assert stats["running"] == 0 and stats["pages_used"] == {"full_attention": 0, "sliding_attention": 0}
    key = "beam_requests_total{endpoint=completions,finish_reason=abort}"
    assert server.metrics().get(key, 0) - before.get(key, 0) == 1
