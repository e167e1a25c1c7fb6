"""POST /v1/completions: plain text (or token ids) in, text out, streamed (SSE) or not, with the
legacy logprobs format. One prompt per request; `response_format` decodes the text under its JSON
schema's grammar. Must never start a stream before the request is
validated and admitted."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from server.api import protocol, structures
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


def legacy_logprobs(tokenizer, logprobs, offset: int) -> dict:
    tokens = [tokenizer.decode([t.token_id]) for t in logprobs]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": [t.logprob for t in logprobs],
            "top_logprobs": [{tokenizer.decode([i]): lp for i, lp in t.top} for t in logprobs],
            "text_offset": offsets}


async def create(request: Request, state) -> Response:
    req = protocol.parse_completion(await read_json(request), state.served_models)
    prompt = req.prompt
    prompt_ids = state.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    structure = structures.completion_structure(req.common.response_schema)
    await check_structure(state, structure, "response_format")
    params = sampling_params(state, req.common, prompt_ids, "prompt", structure)
    rid = new_id("cmpl")
    stream = submit(state, rid, prompt_ids, params)
    timer = state.metrics.timer("completions")
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": req.common.model,
            "system_fingerprint": state.fingerprint}
    if req.common.stream:
        return StreamingResponse(sse_body(_events(state, req, stream, timer, head), stream, timer, len(prompt_ids)),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    outs = await finished(request, stream, timer, len(prompt_ids))
    if outs is None:
        return Response(status_code=499)
    last = outs[-1]
    lps = [lp for o in outs for lp in (o.logprobs or [])]
    choice = {"index": 0, "text": "".join(o.text for o in outs), "finish_reason": last.finish_reason,
              "logprobs": legacy_logprobs(state.tokenizer, lps, 0) if params.logprobs else None}
    return JSONResponse({**head, "choices": [choice], "usage": usage(last)})


async def _events(state, req, stream, timer, head: dict):
    include_usage, offset = req.common.include_usage, 0
    async for out in stream:
        if out.finish_reason == "error":
            raise engine_error(out)
        timer.tokens(len(out.token_ids))
        lp = legacy_logprobs(state.tokenizer, out.logprobs, offset) if out.logprobs else None
        offset += len(out.text)
        body = {**head, "choices": [{"index": 0, "text": out.text, "logprobs": lp,
                                     "finish_reason": out.finish_reason if out.finished else None}]}
        if include_usage:
            body["usage"] = None
        yield sse(body)
        if out.finished and include_usage:
            yield sse({**head, "choices": [], "usage": usage(out)})
