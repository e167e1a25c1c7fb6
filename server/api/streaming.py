"""Shared plumbing of the generation endpoints: reading the body, submitting to the engine, server-
sent events, waiting for a non-streamed result while watching for the client leaving, usage.

Must never leave a request running for a client that is gone: every path closes its stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from server.api.errors import APIError, invalid
from server.engine.async_engine import EngineUnavailable, RequestStream
from server.engine.output import RequestOutput
from server.engine.sampling_params import SamplingParams

DONE = "data: [DONE]\n\n"
log = logging.getLogger("beam.api")


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# Deeper bodies are refused: the parser, templates and json.dumps recurse through them (Python's stack)
MAX_JSON_DEPTH = 64
_SURROGATE = re.compile(r"[\ud800-\udfff]")  # only lone ones survive json.loads (pairs become one character)


def _is_json_type(content_type: str) -> bool:
    kind, _, sub = content_type.split(";", 1)[0].strip().lower().partition("/")
    return kind == "application" and (sub == "json" or (sub.endswith("+json") and len(sub) > 5))


async def read_json(request: Request):
    """The body as JSON: sent as JSON (a browser's cross-site form or text/plain post, which needs no CORS
    preflight, is refused), at most MAX_JSON_DEPTH deep, and every string Unicode text."""
    content_type = request.headers.get("content-type", "")
    if not _is_json_type(content_type):
        got = f"'{content_type}'" if content_type else "none"
        raise invalid(f"the request body must be JSON sent with 'Content-Type: application/json' (got {got})")
    raw = await request.body()
    try:
        body = json.loads(raw)
    except RecursionError:
        raise _too_deep(None) from None
    except ValueError as e:  # bad syntax, bad UTF-8, an integer past Python's digit limit
        raise invalid(f"the request body is not valid JSON: {e}") from None
    _check_values(body)
    return body


def _too_deep(param: str | None) -> APIError:
    return invalid(f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)", param)


def _check_values(body) -> None:
    """Refuse containers nested past MAX_JSON_DEPTH and strings with a lone UTF-16 surrogate (not text:
    it cannot be encoded, tokenized or sent back), naming the top-level field they are in. Iterative,
    so depth costs no stack."""
    stack = [(body, 1, None)]
    while stack:
        value, depth, param = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise _not_text(param)
            continue
        if depth > MAX_JSON_DEPTH:
            raise _too_deep(param)
        if isinstance(value, dict):
            for k, v in value.items():
                if _SURROGATE.search(k):
                    raise _not_text(param)  # a key names no field of its own
                if isinstance(v, (dict, list, str)):
                    stack.append((v, depth + 1, param or k))
        elif isinstance(value, list):
            stack.extend((v, depth + 1, param) for v in value if isinstance(v, (dict, list, str)))


def _not_text(param: str | None) -> APIError:
    where = f"'{param}'" if param else "the request body"
    return invalid(f"{where} contains a lone UTF-16 surrogate (\\ud800-\\udfff), which is not Unicode text", param)


async def check_structure(state, structure: str | None, param: str) -> None:
    """Compile a request's output structure off the event loop (the engine's cache keeps it): a schema
    the grammar engine refuses is a 400 naming `param`."""
    if structure is None:
        return
    try:
        await run_in_threadpool(state.engine.engine.grammars.compile, structure)
    except ValueError as e:
        raise invalid(str(e), param) from None


def sampling_params(state, common, prompt_ids: list[int], prompt_param: str,
                    structure: str | None = None, thinking_token_budget: int | None = None) -> SamplingParams:
    """Resolve max_tokens against the context length and build the engine's SamplingParams."""
    limit = state.max_model_len
    room = limit - len(prompt_ids)
    if room < 1 or (common.max_tokens is not None and common.max_tokens > room):
        asked = f" + {common.max_tokens} completion tokens" if common.max_tokens is not None else ""
        raise invalid(f"this model's maximum context length is {limit} tokens, but the request has "
                      f"{len(prompt_ids)} prompt tokens{asked}", prompt_param, "context_length_exceeded")
    try:
        return SamplingParams(max_tokens=common.max_tokens or room, structure=structure,
                              thinking_token_budget=thinking_token_budget, **common.sampling)
    except ValueError as e:  # a value the engine cannot take (a seed past 64 bits): its field is the param
        raise invalid(str(e), getattr(e, "param", None)) from None


def submit(state, request_id: str, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
    try:
        return state.engine.open(request_id, prompt_ids, params)
    except EngineUnavailable as e:
        code = "shutting_down" if not state.engine.accepting else "overloaded"
        raise APIError(503, str(e), code=code) from None
    except ValueError as e:
        raise invalid(str(e), "prompt") from None


class ClientGone(Exception):
    pass


async def collect(request: Request, stream: RequestStream, on_output=None) -> list[RequestOutput]:
    """All outputs of a non-streamed request; aborts it (ClientGone) if the client disconnects.
    `on_output(num_new_tokens)` is called as outputs arrive (latency metrics)."""
    async def consume():
        outs = []
        async for o in stream:
            outs.append(o)
            if on_output is not None:
                on_output(len(o.token_ids))
        return outs

    task = asyncio.ensure_future(consume())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.2)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
        stream.close()


async def finished(request: Request, stream: RequestStream, timer, num_prompt: int) -> list[RequestOutput] | None:
    """A non-streamed request's outputs, counted once in the metrics; None if the client left (the
    caller answers 499); an engine failure is raised as a 500."""
    try:
        outs = await collect(request, stream, on_output=timer.tokens)
    except ClientGone:
        timer.finish("abort", num_prompt, 0)
        return None
    last = outs[-1]
    timer.finish(last.finish_reason, last.num_prompt_tokens, last.num_output_tokens)
    if last.finish_reason == "error":
        raise engine_error(last)
    return outs


async def sse_body(events, stream: RequestStream, timer, num_prompt: int):
    """An endpoint's SSE events, guarded: an error after the stream started becomes an error event
    followed by [DONE]; the request is closed (aborted if unfinished) and counted exactly once."""
    reason = "abort"  # what it stays if the client leaves (the generator is closed mid-way)
    try:
        async for piece in events:
            yield piece
        reason = stream.last.finish_reason if stream.last else "abort"
    except APIError as e:
        reason = "error"
        yield e.sse()
    except EngineUnavailable as e:
        reason = "error"
        yield APIError(503, str(e), code="shutting_down").sse()
    except Exception:  # noqa: BLE001 - a bug must still end the stream in the documented way
        log.exception("stream failed")
        reason = "error"
        yield APIError(500, "internal server error", code="internal_error").sse()
    finally:
        stream.close()
        timer.finish(reason, num_prompt, stream.last.num_output_tokens if stream.last else 0)
    yield DONE


def usage(last: RequestOutput) -> dict:
    return {"prompt_tokens": last.num_prompt_tokens, "completion_tokens": last.num_output_tokens,
            "total_tokens": last.num_prompt_tokens + last.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": last.num_cached_tokens}}


def engine_error(out: RequestOutput) -> APIError:
    return APIError(500, out.error or "generation failed", code="engine_error")
