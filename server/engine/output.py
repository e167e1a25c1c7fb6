"""What the engine reports for a request after a step: the new tokens, the text they released, and
at the end why it finished. Plain data; never holds engine objects (it crosses threads)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # most likely first


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]               # generated this step (several where a drafter's drafts were kept)
    text: str                          # text released this step (stop strings never appear)
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None          # "stop", "length", "abort" or "error" once finished
    num_prompt_tokens: int
    num_output_tokens: int             # all generated so far, stop tokens included
    num_cached_tokens: int             # prompt tokens served from the prefix cache
    error: str | None = None
