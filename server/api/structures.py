"""What a request says the output must look like -> the grammar it is decoded under: a Lark grammar in
llguidance's dialect (`SamplingParams.structure`), written in the chat template's own tokens.

A chat turn is `<|think|>REASONING<|/think|>ANSWER`, then the end token (the grammar's stop token).
The reasoning is free text (template tokens are tokens, never text, so none is inside it); a
`thinking_token_budget` closes it after that many tokens (the engine narrows the grammar's mask:
engine/reasoning_budget.py), so a budget needs the template's grammar. The answer is one of:
- tool calls, `<|tool_call|>{"name": ..., "arguments": ...}<|/tool_call|>` each, the arguments valid
  against the named tool's JSON schema: forced (`tool_choice` required or named; one call, or one or
  more with `parallel_tool_calls`), or offered beside free text (`auto`: text, and a call wherever the
  model starts one with `<|tool_call|>`);
- a JSON value valid against `response_format`'s schema (or, with tools offered, that or calls);
- free text.
A completion's structure is only its `response_format` value. `CONSTRAIN` modes say what is decoded
under a grammar when the request does not ask for one itself (`--constrained-decoding`).
Must never compile or touch the engine: the engine compiles what this module writes.
"""

from __future__ import annotations

import json

from beam_model.chat_template import END_THINK, END_TOOL_CALL, THINK, TOOL_CALL

# "tools": requests that offer tools are decoded under the template's grammar (calls always parse and
# match their tool's schema); "all": every chat turn is; "off": only an explicit response_format (and a
# thinking budget) is, and tool_choice required/named only prefills the start of a call.
CONSTRAIN = ("tools", "all", "off")
# JSON as the template writes it (json.dumps: one space after ':' and ','), or compact: at most one
# space between JSON tokens, never an endless run of whitespace
JSON_OPTIONS = {"whitespace_pattern": "[ ]?"}
TEXT = "/(?s:.*)/"  # any text: bytes only, so never a template token


def _json(schema: dict) -> str:
    schema = {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def call_schema(tool: dict) -> dict:
    """The JSON schema of one call of `tool` (an OpenAI tool): its name, its arguments' schema."""
    fn = tool["function"]
    return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": fn["name"]},
                           "arguments": fn.get("parameters") or {"type": "object"}}}


def _rules(answer: str, tools: list[dict] | None) -> str:
    lines = [f"start: {THINK} reasoning {END_THINK} answer", f"reasoning: {TEXT}", f"answer: {answer}",
             f"text: {TEXT}"]
    if tools:
        schemas = [call_schema(t) for t in tools]
        lines.append(f"call: {TOOL_CALL} {_json(schemas[0] if len(schemas) == 1 else {'anyOf': schemas})} "
                     f"{END_TOOL_CALL}")
    return "\n".join(lines) + "\n"


def chat_structure(req, constrain: str) -> str | None:
    """The structure of a chat request's answer (`req`: protocol.ChatRequest), or None (free decoding)."""
    tools = req.tools if req.tool_choice != "none" else None
    if tools and req.tool_choice == "named":
        tools = [t for t in tools if t["function"]["name"] == req.tool_name]
    schema, budget = req.common.response_schema, req.thinking_token_budget
    forced = bool(tools) and req.tool_choice in ("required", "named")
    if forced and constrain == "off":
        return None  # the call's start is prefilled (chat.forced_prefix), its reasoning empty
    calls = "call+" if req.parallel_tool_calls else "call"
    if forced:
        answer = calls
    elif schema is not None:
        answer = _json(schema) + (f" | {calls}" if tools and constrain != "off" else "")
    elif tools and constrain != "off":
        answer = "text (call text)*" if req.parallel_tool_calls else "text (call text)?"
    elif constrain == "all" or budget is not None:
        answer = "text"
    else:
        return None
    return _rules(answer, tools if constrain != "off" else None)


def completion_structure(schema: dict | None) -> str | None:
    return None if schema is None else f"start: {_json(schema)}\n"
