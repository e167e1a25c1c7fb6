"""Structured outputs end to end: a real `workbench serve` (beam-tiny, random weights, CPU) driven by the
official `openai` client, every output judged with `jsonschema`. Forced, required and offered tool calls,
`parallel_tool_calls`, `response_format` json_schema / json_object (chat and completions, streamed and
not), `thinking_token_budget`, and a server started with `--constrained-decoding off`.

The model is noise, so the schemas are bounded (enums, bounded integers, booleans, strings with a
maxLength) and the reasoning has a small budget: a turn under such a grammar has a bounded length far
below max_tokens, so it must end by itself ('tool_calls' or 'stop'), never by 'length'. Prompts never
contain the scripted test model's triggers (tests/server_harness.py SCRIPT), so every token is sampled.
"""

import asyncio
import json
import signal

import jsonschema
import pytest

from beam_model.chat_template import encode_chat
from beam_model.tokenizer import ByteTokenizer
from tests.server_harness import MODEL, ServerProcess

TOK = ByteTokenizer()

# Each call is at most ~130 tokens (a string of 4 characters is at most 4 \uXXXX escapes), far below MAX_TOKENS.
ALARM = {"type": "function", "function": {
    "name": "set_alarm", "description": "Set an alarm",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["label", "hour", "loud"],
                   "properties": {"label": {"type": "string", "maxLength": 4},
                                  "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                  "loud": {"type": "boolean"}}}}}
MOVE = {"type": "function", "function": {
    "name": "move", "description": "Move on the board",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["dir", "steps"],
                   "properties": {"dir": {"enum": ["north", "south", "east", "west"]},
                                  "steps": {"type": "integer", "minimum": 1, "maximum": 9}}}}}
TOOLS = [ALARM, MOVE]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
THING = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "tag"],
         "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": -5, "maximum": 5},
                        "tag": {"type": "string", "maxLength": 3}, "kind": {"enum": ["a", "b"]},
                        "marks": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}}}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "thing", "schema": THING, "strict": True}}
MAX_TOKENS = 300
BUDGET = 2
PROMPTS = ["Wake me up at seven", "Which way to the castle?", "hello", "Set an alarm for the gym, loud please",
           "Move three steps north", "¿Qué hora es?", "Call me when it is done.", "42", "Go west, then stop",
           "Ein Wecker um 6 Uhr bitte", "what's up", "{\"json\": true}"]


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def check_call(name: str, arguments: str, allowed=tuple(SCHEMAS)) -> None:
    assert name in allowed, name
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def check_reasoning(reasoning: str | None, budget: int = BUDGET) -> None:
    """At most `budget` byte tokens, whole characters only (the budget never cuts one)."""
    assert reasoning is None or (len(reasoning.encode()) <= budget and "\ufffd" not in reasoning), repr(reasoning)


def chat(client, content: str, **kw):
    kw.setdefault("max_tokens", MAX_TOKENS)
    extra = {"thinking_token_budget": BUDGET, **kw.pop("extra_body", {})}
    return client.chat.completions.create(model=MODEL, messages=user(content), extra_body=extra, **kw)


def calls_of(response) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in response.choices[0].message.tool_calls or []]


def assemble(chunks) -> dict:
    """A streamed chat turn from its chunks: finish_reason, content, reasoning, calls [(name, arguments)]."""
    calls, content, reasoning, finish = {}, [], [], []
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content.append(delta.content or "")
        reasoning.append(getattr(delta, "reasoning_content", None) or "")
        for tc in delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.function.name, "a call's first delta names it"
                calls[tc.index] = [tc.function.name, ""]
            calls[tc.index][1] += tc.function.arguments or ""
        if choice.finish_reason:
            finish.append(choice.finish_reason)
    assert len(finish) == 1, finish
    return {"finish_reason": finish[0], "content": "".join(content), "reasoning": "".join(reasoning) or None,
            "calls": [tuple(calls[i]) for i in sorted(calls)]}


def stream_chat(client, content: str, **kw) -> dict:
    return assemble(chat(client, content, stream=True, **kw))


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess()
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM), srv.log()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


# ------------------------------------------------------------------ forced calls

def test_a_forced_named_call_is_always_one_valid_call_of_that_tool(client):
    for i, prompt in enumerate(PROMPTS):
        name = TOOLS[i % 2]["function"]["name"]
        r = chat(client, prompt, tools=TOOLS, tool_choice=named(name), parallel_tool_calls=False)
        assert r.choices[0].finish_reason == "tool_calls", r
        ((got, arguments),) = calls_of(r)
        assert got == name
        check_call(got, arguments)
        check_reasoning(r.choices[0].message.reasoning_content)


def test_a_streamed_forced_named_call_reassembles_to_a_valid_call(client):
    for i, prompt in enumerate(PROMPTS):
        name = TOOLS[(i + 1) % 2]["function"]["name"]
        turn = stream_chat(client, prompt, tools=TOOLS, tool_choice=named(name), parallel_tool_calls=False)
        assert turn["finish_reason"] == "tool_calls", turn
        ((got, arguments),) = turn["calls"]
        assert got == name and not turn["content"]
        check_call(got, arguments)
        check_reasoning(turn["reasoning"])


def test_concurrent_forced_named_calls_are_each_valid(server):
    """16 at once (streamed and not): the masks of many rows are filled together in each step."""
    client = server.async_client()

    async def one(i):
        name = TOOLS[i % 2]["function"]["name"]
        kw = dict(tools=TOOLS, tool_choice=named(name), parallel_tool_calls=False)
        if i % 4 == 3:
            return name, assemble([c async for c in await chat(client, f"{PROMPTS[i % 12]} #{i}", stream=True, **kw)])
        r = await chat(client, f"{PROMPTS[i % 12]} #{i}", **kw)
        return name, {"finish_reason": r.choices[0].finish_reason, "calls": calls_of(r)}

    async def run_all():
        async with client:
            return await asyncio.gather(*(one(i) for i in range(16)))

    for name, turn in asyncio.run(run_all()):
        assert turn["finish_reason"] == "tool_calls", turn
        ((got, arguments),) = turn["calls"]
        assert got == name
        check_call(got, arguments)


def test_required_makes_exactly_one_call_or_parallel_calls(server):
    """Two tools, tool_choice required: one valid call without parallel calls; with them, one or more,
    nothing but calls after the reasoning (any number: seeded, so the count is reproducible)."""
    client = server.async_client()

    async def run_all():
        async with client:
            return await asyncio.gather(*(
                chat(client, f"{PROMPTS[i % 12]} #{i}", tools=TOOLS, tool_choice="required", seed=i,
                     parallel_tool_calls=i >= 4, max_tokens=2 * MAX_TOKENS) for i in range(16)))

    responses = asyncio.run(run_all())
    for i, r in enumerate(responses):
        assert r.choices[0].finish_reason == "tool_calls", r
        calls = calls_of(r)
        assert len(calls) == 1 if i < 4 else calls
        for name, arguments in calls:
            check_call(name, arguments)
        assert r.choices[0].message.content is None
    print(f"parallel calls: {[len(calls_of(r)) for r in responses[4:]]} calls a turn")


# ------------------------------------------------------------------ offered calls

def test_auto_calls_are_valid_whenever_the_model_makes_them(server):
    """tool_choice auto: free text with calls wherever the model opens one; every call made validates
    (cut turns included: a call is shown only once its JSON is whole), and without parallel calls a turn
    has at most one. With a response_format too, the answer is that JSON or calls: bounded, so it ends."""
    client = server.async_client()

    async def run_all():
        async with client:
            free = [chat(client, p, tools=TOOLS, seed=i, parallel_tool_calls=bool(i % 2))
                    for i, p in enumerate(PROMPTS)]
            either = [chat(client, p, tools=TOOLS, seed=i, parallel_tool_calls=False, response_format=JSON_SCHEMA)
                      for i, p in enumerate(PROMPTS[:8])]
            done = await asyncio.gather(*free, *either)
            return done[:len(free)], done[len(free):]

    free, either = asyncio.run(run_all())
    for i, r in enumerate(free):
        calls = calls_of(r)
        assert r.choices[0].finish_reason in (("tool_calls", "length") if calls else ("stop", "length"))
        assert len(calls) <= 1 or i % 2
        for name, arguments in calls:
            check_call(name, arguments)
    for r in either:
        calls, content = calls_of(r), r.choices[0].message.content
        assert r.choices[0].finish_reason == ("tool_calls" if calls else "stop"), r
        if calls:
            assert len(calls) == 1 and not content
            check_call(*calls[0])
        else:
            jsonschema.validate(json.loads(content), THING)
    print(f"auto: {sum(bool(calls_of(r)) for r in free)}/{len(free)} free turns and "
          f"{sum(bool(calls_of(r)) for r in either)}/{len(either)} JSON-or-call turns made calls")


# ------------------------------------------------------------------ response_format

def test_json_schema_chat_content_validates_streamed_and_not(client):
    for prompt in PROMPTS[:4]:
        r = chat(client, prompt, response_format=JSON_SCHEMA)
        assert r.choices[0].finish_reason == "stop", r
        jsonschema.validate(json.loads(r.choices[0].message.content), THING)
        check_reasoning(r.choices[0].message.reasoning_content)
        turn = stream_chat(client, prompt, response_format=JSON_SCHEMA)
        assert turn["finish_reason"] == "stop" and not turn["calls"], turn
        jsonschema.validate(json.loads(turn["content"]), THING)


def test_json_schema_completion_text_validates_streamed_and_not(client):
    for prompt in ["The thing:", "x", "Once upon a time"]:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                      extra_body={"response_format": JSON_SCHEMA})
        assert r.choices[0].finish_reason == "stop", r
        jsonschema.validate(json.loads(r.choices[0].text), THING)
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
                                                extra_body={"response_format": JSON_SCHEMA}))
        assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]
        jsonschema.validate(json.loads("".join(c.choices[0].text for c in chunks)), THING)


def test_json_object_outputs_that_finish_are_objects(client):
    """Any object: unbounded, so a turn may be cut by max_tokens; every one that ends is an object."""
    outputs = []
    for prompt in PROMPTS[:3]:
        r = chat(client, prompt, response_format={"type": "json_object"}, max_tokens=120)
        outputs.append((r.choices[0].finish_reason, r.choices[0].message.content))
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=120,
                                      extra_body={"response_format": {"type": "json_object"}})
        outputs.append((r.choices[0].finish_reason, r.choices[0].text))
    assert {reason for reason, _ in outputs} <= {"stop", "length"}
    for reason, text in outputs:
        if reason == "stop":
            assert isinstance(json.loads(text), dict), text


# ------------------------------------------------------------------ reasoning budget

@pytest.mark.parametrize("budget", [0, 1, 3])
def test_thinking_token_budget_bounds_the_reasoning(client, budget):
    """The tokens between <|think|> and <|/think|> (read from logprobs: one entry a token) are at most
    the budget, and reasoning_content is their text; a budget of 0 leaves no reasoning. Seeded: the
    reasoning the model chose is reproducible, streamed or not."""
    first = None
    for seed, prompt in enumerate(PROMPTS[:3]):
        r = chat(client, prompt, max_tokens=24, logprobs=True, seed=seed, extra_body={"thinking_token_budget": budget})
        tokens = [t.token for t in r.choices[0].logprobs.content]
        assert tokens[0] == "<|think|>" and "<|/think|>" in tokens, tokens
        thought = r.choices[0].logprobs.content[1:tokens.index("<|/think|>")]
        assert len(thought) <= budget
        reasoning = r.choices[0].message.reasoning_content
        assert reasoning == (bytes(b for t in thought for b in t.bytes).decode(errors="replace") or None)
        assert (reasoning is None) == (budget == 0)
        check_reasoning(reasoning, budget)
        first = first or r.choices[0].message
    turn = stream_chat(client, PROMPTS[0], max_tokens=24, seed=0, extra_body={"thinking_token_budget": budget})
    assert (turn["reasoning"], turn["content"]) == (first.reasoning_content, first.content)  # the same draws


# ------------------------------------------------------------------ --constrained-decoding off

@pytest.fixture(scope="module")
def off_server():
    srv = ServerProcess("--constrained-decoding", "off")
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM), srv.log()


def test_constraining_off_prefills_forced_calls_but_still_enforces_response_format(client, off_server):
    off = off_server.client()
    messages = user(PROMPTS[0])
    prompt_tokens = len(encode_chat(TOK, messages, TOOLS))
    prefix = '<|think|><|/think|><|tool_call|>{"name": "set_alarm", "arguments": '
    r = off.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=named("set_alarm"),
                                    max_tokens=24)
    # the old path: the start of the call is part of the prompt; the rest is whatever the model wrote
    assert r.usage.prompt_tokens == prompt_tokens + len(TOK.encode(prefix))
    m = r.choices[0].message
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls") and m.reasoning_content is None
    assert [c.function.name for c in m.tool_calls or []] in ([], ["set_alarm"])
    if not m.tool_calls:
        assert m.content.startswith('<|tool_call|>{"name": "set_alarm", "arguments": ')
    on = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=named("set_alarm"),
                                        max_tokens=MAX_TOKENS, extra_body={"thinking_token_budget": BUDGET})
    assert on.usage.prompt_tokens == prompt_tokens  # under the grammar nothing is prefilled

    for prompt in PROMPTS[:3]:  # response_format is still decoded under its schema, tools offered or not
        for tools in (None, TOOLS):
            kw = {"tools": tools} if tools else {}
            r = chat(off, prompt, response_format=JSON_SCHEMA, **kw)
            assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls, r
            jsonschema.validate(json.loads(r.choices[0].message.content), THING)
            check_reasoning(r.choices[0].message.reasoning_content)
    r = off.completions.create(model=MODEL, prompt="x", max_tokens=MAX_TOKENS,
                               extra_body={"response_format": JSON_SCHEMA})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), THING)
