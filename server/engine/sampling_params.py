"""Per-request sampling settings, as the engine sees them (already translated from the API).

Validated once at construction so the engine loop never meets a bad value; the HTTP layer maps the
`ValueError`s (each names its field as `param`) to 400s. This module must never import torch or know about HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_TOP_LOGPROBS = 20
# What torch.Generator.manual_seed takes: a seed outside it raises inside the model step
SEED_MIN, SEED_MAX = -2**63, 2**64 - 1


class SamplingParamError(ValueError):
    """A bad value of one field; `param` names it (the API's name for the same setting)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingParamError(param, message)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0                # 1 = off
    top_k: int = 0                    # 0 = off
    seed: int | None = None           # set: this request's draws are reproducible on their own
    stop: tuple[str, ...] = ()        # stop strings: never included in the output text
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # The output's structure (an xgrammar structural tag, JSON text; server/api/structures.py builds it):
    # every token is drawn under its grammar's mask. None: free text.
    structure: str | None = None
    thinking_token_budget: int | None = None  # the reasoning's most tokens (needs the template's structure)

    def __post_init__(self):
        _require(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
                 "max_tokens must be an integer >= 1")
        _require(0.0 <= self.temperature <= 2.0, "temperature", "temperature must be between 0 and 2")
        _require(0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]")
        _require(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "top_k must be an integer >= 0 (0 = off)")
        seed = self.seed
        _require(seed is None or (isinstance(seed, int) and not isinstance(seed, bool)), "seed",
                 "seed must be an integer")
        _require(seed is None or SEED_MIN <= seed <= SEED_MAX, "seed",
                 f"seed must be between {SEED_MIN} and {SEED_MAX} (a 64-bit integer)")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings")
        _require(0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs",
                 f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
        _require(self.structure is None or isinstance(self.structure, str), "response_format",
                 "the output structure must be JSON text")
        budget = self.thinking_token_budget
        _require(budget is None or (isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0),
                 "thinking_token_budget", "thinking_token_budget must be an integer >= 0")
        _require(budget is None or self.structure is not None, "thinking_token_budget",
                 "thinking_token_budget needs the chat template's structure")
        _require(not (self.structure and self.ignore_eos), "ignore_eos",
                 "ignore_eos cannot be used with a structured output (its grammar ends at the end of the structure)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
