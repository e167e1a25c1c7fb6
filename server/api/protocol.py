"""Request bodies of the OpenAI API -> validated, plain Python values.

Every field the server honours is checked here, with OpenAI's `param` name in the error, so the
handlers never see a bad value. Unknown fields are ignored (clients send `user`, `metadata`, ...);
fields we cannot honour with a non-default value (n > 1, penalties, logit_bias, echo, ...) are a
400, never silently dropped. Must never touch the engine or the tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server.api.errors import APIError, invalid
from server.engine.sampling_params import MAX_TOP_LOGPROBS

MAX_STOP_STRINGS = 16


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _opt(body: dict, name: str, check, what: str, default=None):
    v = body.get(name)
    if v is None:
        return default
    if not check(v):
        raise invalid(f"'{name}' must be {what}", name)
    return v


def _response_schema(fmt) -> dict | None:
    """`response_format` -> the JSON schema the output must follow, or None for free text. Every schema
    is enforced (`strict` or not): the output is decoded under its grammar."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise invalid("'response_format' must be {'type': 'text' | 'json_object' | 'json_schema', ...}",
                      "response_format")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise invalid("'response_format.json_schema' must be an object with a 'name' and a 'schema'",
                      "response_format.json_schema")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise invalid("'response_format.json_schema.schema' must be a JSON Schema object",
                      "response_format.json_schema.schema")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise invalid("'response_format.json_schema.strict' must be a boolean", "response_format.json_schema.strict")
    return schema


@dataclass
class Common:
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None          # None: up to the context length
    sampling: dict = field(default_factory=dict)  # SamplingParams fields except max_tokens and structure
    response_schema: dict | None = None  # the JSON schema `response_format` asks for (None: text)


def parse_common(body, served_models: list[str]) -> Common:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required", "model")
    if model not in served_models:
        raise APIError(404, f"the model '{model}' does not exist; served: {', '.join(served_models)}",
                       param="model", code="model_not_found")
    stream = _opt(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    options = _opt(body, "stream_options", lambda v: isinstance(v, dict), "an object")
    if options is not None and not stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
    include_usage = _opt(options or {}, "include_usage", lambda v: isinstance(v, bool), "a boolean", False)
    n = _opt(body, "n", _is_int, "an integer", 1)
    if n != 1:
        raise invalid("only n=1 is supported", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if _opt(body, name, _is_num, "a number", 0) != 0:
            raise invalid(f"'{name}' is not supported (must be 0)", name)
    if body.get("logit_bias"):
        raise invalid("'logit_bias' is not supported", "logit_bias")
    response_schema = _response_schema(body.get("response_format"))
    max_tokens = body.get("max_completion_tokens")
    param = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, param = body.get("max_tokens"), "max_tokens"
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise invalid(f"'{param}' must be an integer >= 1", param)
    temperature = _opt(body, "temperature", _is_num, "a number", 1.0)
    if not 0 <= temperature <= 2:
        raise invalid("'temperature' must be between 0 and 2", "temperature")
    top_p = _opt(body, "top_p", _is_num, "a number", 1.0)
    if not 0 < top_p <= 1:
        raise invalid("'top_p' must be greater than 0 and at most 1", "top_p")
    top_k = _opt(body, "top_k", _is_int, "an integer", 0)  # vLLM's extension: -1 or 0 = off
    if top_k < -1:
        raise invalid("'top_k' must be -1, 0 (off) or a positive integer", "top_k")
    seed = _opt(body, "seed", _is_int, "an integer")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
                             or not all(isinstance(s, str) and s for s in stop)):
        raise invalid(f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them", "stop")
    stop_ids = _opt(body, "stop_token_ids", lambda v: isinstance(v, list) and all(map(_is_int, v)),
                    "a list of integers", [])
    ignore_eos = _opt(body, "ignore_eos", lambda v: isinstance(v, bool), "a boolean", False)
    sampling = dict(temperature=float(temperature), top_p=float(top_p), top_k=max(top_k, 0), seed=seed,
                    stop=tuple(stop or ()), stop_token_ids=tuple(stop_ids), ignore_eos=ignore_eos)
    return Common(model, stream, include_usage, max_tokens, sampling, response_schema)


# ---------------------------------------------------------------------------- chat

@dataclass
class ChatRequest:
    common: Common
    messages: list
    tools: list | None
    tool_choice: str            # "auto", "none", "required" or "named"
    tool_name: str | None       # the function when tool_choice is "named"
    parallel_tool_calls: bool = True
    thinking_token_budget: int | None = None  # the reasoning closes after this many tokens


def _check_tools(tools) -> None:
    if not isinstance(tools, list):
        raise invalid("'tools' must be a list", "tools")
    for k, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise invalid(f"tools[{k}] must be {{'type': 'function', 'function': {{'name': ...}}}}", f"tools[{k}]")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise invalid(f"tools[{k}].function.parameters must be a JSON Schema object",
                          f"tools[{k}].function.parameters")


def parse_chat(body, served_models: list[str]) -> ChatRequest:
    common = parse_common(body, served_models)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list", "messages")
    logprobs = _opt(body, "logprobs", lambda v: isinstance(v, bool), "a boolean", False)
    top = _opt(body, "top_logprobs", _is_int, "an integer", 0)
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise invalid(f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}", "top_logprobs")
    if top and not logprobs:
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    common.sampling.update(logprobs=logprobs, top_logprobs=top)
    tools = body.get("tools") or None
    if tools is not None:
        _check_tools(tools)
    choice = body.get("tool_choice")
    name = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise invalid("'tool_choice' must be 'auto', 'none', 'required' or "
                          "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        choice = "named"
    elif choice not in ("auto", "none", "required"):
        raise invalid("'tool_choice' must be 'auto', 'none', 'required' or a named function", "tool_choice")
    if choice in ("required", "named") and not tools:
        raise invalid(f"tool_choice '{choice}' needs 'tools'", "tool_choice")
    if name is not None and name not in {t["function"]["name"] for t in tools}:
        raise invalid(f"tool_choice names '{name}', which is not among the tools", "tool_choice")
    parallel = _opt(body, "parallel_tool_calls", lambda v: isinstance(v, bool), "a boolean", True)
    budget = _opt(body, "thinking_token_budget", lambda v: _is_int(v) and v >= 0, "an integer >= 0")
    return ChatRequest(common, messages, tools, choice, name, parallel, budget)


# ----------------------------------------------------------------------- completions

@dataclass
class CompletionRequest:
    common: Common
    prompt: str | list[int]


def parse_completion(body, served_models: list[str]) -> CompletionRequest:
    common = parse_common(body, served_models)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    ok = isinstance(prompt, str) or (isinstance(prompt, list) and all(map(_is_int, prompt)))
    if not ok:
        raise invalid("'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")
    if not prompt:
        raise invalid("'prompt' is empty", "prompt")
    if body.get("echo"):
        raise invalid("'echo' is not supported", "echo")
    if body.get("suffix") is not None:
        raise invalid("'suffix' is not supported", "suffix")
    if _opt(body, "best_of", _is_int, "an integer", 1) != 1:
        raise invalid("only best_of=1 is supported", "best_of")
    logprobs = _opt(body, "logprobs", _is_int, "an integer")
    if logprobs is not None and not 0 <= logprobs <= 5:
        raise invalid("'logprobs' must be between 0 and 5", "logprobs")
    common.sampling.update(logprobs=logprobs is not None, top_logprobs=logprobs or 0)
    if common.max_tokens is None:
        common.max_tokens = 16  # OpenAI's default for legacy completions (chat: up to the context)
    return CompletionRequest(common, prompt)
