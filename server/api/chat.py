"""POST /v1/chat/completions: render the chat template, generate, parse reasoning / content /
tool calls back out, streamed (SSE) or not.

Reasoning (`<|think|>...<|/think|>`) becomes `reasoning_content` (and `reasoning`); tool-call
blocks become OpenAI `tool_calls` (streamed as the name, then the arguments). The answer is decoded
under the grammar `structures.chat_structure` writes (forced and offered tool calls, response_format,
thinking_token_budget), so a call parses and matches its tool's schema. With constraining off
(`--constrained-decoding off`), tool_choice "required" / a named function only prefills the assistant
turn with `<|think|><|/think|><|tool_call|>` (+ `{"name": NAME, "arguments": ` when named); a block
that is not valid JSON is reported as content, never an error. Must never start a stream before the
request is validated and admitted: every 4xx/503 is a plain HTTP error.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from beam_model.chat_template import END_THINK, END_TOOL_CALL, THINK, TOOL_CALL, AssistantStreamParser, encode_chat
from beam_model.tokenizer import ByteTokenizer
from server.api import protocol, structures
from server.api.errors import invalid
from server.api.streaming import (
    check_structure,
    engine_error,
    finished,
    new_id,
    read_json,
    sampling_params,
    sse,
    sse_body,
    submit,
    usage,
)


def forced_prefix(req: protocol.ChatRequest) -> str:
    if req.tool_choice == "required":
        return THINK + END_THINK + TOOL_CALL
    if req.tool_choice == "named":
        return THINK + END_THINK + TOOL_CALL + '{"name": ' + json.dumps(req.tool_name) + ', "arguments": '
    return ""


class Translator:
    """Generated text -> OpenAI message deltas, through the template's stream parser."""

    def __init__(self, prefix: str, allow_tools: bool):
        self.parser = AssistantStreamParser()
        self.allow_tools = allow_tools
        self.calls: list[dict] = []   # the tool calls so far, OpenAI shape
        self.reasoning, self.content = [], []
        self._names: dict[int, str] = {}
        self.feed(prefix)  # the forced prefix is part of the assistant turn the parser reads

    def feed(self, text: str) -> list[dict]:
        return self._deltas(self.parser.feed(text)) if text else []

    def finish(self) -> list[dict]:
        return self._deltas(self.parser.finish())

    def finish_reason(self, engine_reason: str) -> str:
        return "tool_calls" if self.calls and engine_reason == "stop" else engine_reason

    def _deltas(self, events) -> list[dict]:
        out = []
        for ev in events:
            kind = ev[0]
            if kind == "reasoning":
                self.reasoning.append(ev[1])
                out.append({"reasoning_content": ev[1], "reasoning": ev[1]})
            elif kind == "content":
                self.content.append(ev[1])
                out.append({"content": ev[1]})
            elif not self.allow_tools:  # tool_choice "none": a call the model made anyway is text
                if kind == "tool_call_start":
                    self._names[ev[1]] = ev[2]
                else:
                    body = json.dumps({"name": self._names.pop(ev[1]), "arguments": json.loads(ev[2])})
                    text = TOOL_CALL + body + END_TOOL_CALL
                    self.content.append(text)
                    out.append({"content": text})
            elif kind == "tool_call_start":
                call = {"index": ev[1], "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                        "function": {"name": ev[2], "arguments": ""}}
                self.calls.append(call)
                out.append({"tool_calls": [json.loads(json.dumps(call))]})
            else:  # tool_call_args
                self.calls[ev[1]]["function"]["arguments"] += ev[2]
                out.append({"tool_calls": [{"index": ev[1], "function": {"arguments": ev[2]}}]})
        return out

    def message(self) -> dict:
        reasoning = "".join(self.reasoning) or None
        content = "".join(self.content)
        msg = {"role": "assistant", "content": content if content or not self.calls else None,
               "reasoning_content": reasoning, "reasoning": reasoning}
        if self.calls:
            msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in self.calls]
        return msg


def logprob_content(tokenizer, logprobs) -> list[dict]:
    def entry(i, lp):
        text = tokenizer.decode([i])
        raw = [i] if isinstance(tokenizer, ByteTokenizer) and i < 256 else list(text.encode())  # the byte itself
        return {"token": text, "logprob": lp, "bytes": raw}
    return [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]} for t in logprobs]


async def create(request: Request, state) -> Response:
    req = protocol.parse_chat(await read_json(request), state.served_models)
    tools = req.tools if req.tool_choice != "none" else None  # "none": the model is not offered tools
    try:
        prompt_ids = encode_chat(state.tokenizer, req.messages, tools)
    except ValueError as e:
        raise invalid(str(e), "messages") from None
    structure = structures.chat_structure(req, state.constrain)
    await check_structure(state, structure, "response_format" if req.common.response_schema else "tools")
    # Without a grammar, a forced call is prefilled: the server's own markers, special tokens allowed
    prefix = forced_prefix(req) if structure is None else ""
    prompt_ids += state.tokenizer.encode(prefix)
    budget = req.thinking_token_budget if structure is not None else None  # off + forced: no reasoning
    params = sampling_params(state, req.common, prompt_ids, "messages", structure, budget)
    rid = new_id("chatcmpl")
    stream = submit(state, rid, prompt_ids, params)
    timer = state.metrics.timer("chat")
    translator = Translator(prefix, allow_tools=req.tool_choice != "none")
    head = {"id": rid, "created": int(time.time()), "model": req.common.model,
            "system_fingerprint": state.fingerprint}
    if req.common.stream:
        events = _events(state, req, stream, timer, translator, head)
        return StreamingResponse(sse_body(events, stream, timer, len(prompt_ids)),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    outs = await finished(request, stream, timer, len(prompt_ids))
    if outs is None:
        return Response(status_code=499)
    last = outs[-1]
    for o in outs:
        translator.feed(o.text)
    translator.finish()
    lps = [lp for o in outs for lp in (o.logprobs or [])]
    choice = {"index": 0, "message": translator.message(),
              "logprobs": {"content": logprob_content(state.tokenizer, lps)} if params.logprobs else None,
              "finish_reason": translator.finish_reason(last.finish_reason)}
    return JSONResponse({**head, "object": "chat.completion", "choices": [choice], "usage": usage(last)})


async def _events(state, req, stream, timer, translator: Translator, head: dict):
    include_usage = req.common.include_usage

    def chunk(delta: dict, finish_reason=None, logprobs=None) -> str:
        body = {**head, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
        if include_usage:
            body["usage"] = None
        return sse(body)

    async for out in stream:
        if out.finish_reason == "error":
            raise engine_error(out)
        if timer.first:  # the first token exists: tell the client right away
            yield chunk({"role": "assistant", "content": ""})
        timer.tokens(len(out.token_ids))
        lp = {"content": logprob_content(state.tokenizer, out.logprobs)} if out.logprobs else None
        for delta in translator.feed(out.text):
            yield chunk(delta, logprobs=lp)
            lp = None
        if lp:
            yield chunk({}, logprobs=lp)
        if out.finished:
            for delta in translator.finish():
                yield chunk(delta)
            yield chunk({}, finish_reason=translator.finish_reason(out.finish_reason))
            if include_usage:
                yield sse({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage(out)})
