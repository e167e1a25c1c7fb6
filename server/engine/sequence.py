"""One request's state inside the engine: its tokens, how far the KV cache has got, its pages.

`token_ids` is the prompt followed by every generated token; `num_computed` counts the leading
tokens whose K/V are in the cache. What a step feeds is `token_ids[num_computed:]` (a prompt chunk,
or the one token sampled last step), so prefill, decode and recompute after preemption are the
same thing. A sequence never touches pages itself: the block manager fills `pages`.
"""

from __future__ import annotations

import itertools
import time
from enum import Enum

from beam_model.config import FULL, SLIDING
from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.sampling_params import SamplingParams

_ids = itertools.count()


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 detokenizer: IncrementalDetokenizer):
        self.seq_id = next(_ids)  # unique, orders arrivals (preemption picks the newest)
        self.request_id = request_id
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.params = params
        self.detokenizer = detokenizer
        self.status = Status.WAITING
        self.num_computed = 0
        self.num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache, first admission
        self.pages: dict[str, list[int]] = {FULL: [], SLIDING: []}  # logical page -> page id, -1 released
        self.page_hashes: list[bytes] = []  # hash chain of this sequence's full pages, in order
        self.generator = None               # per-request torch.Generator (seeded requests only)
        self.matcher = None                 # its grammar's matcher (structured outputs only): engine/grammar.py
        self.draft = None                   # its drafter state (with a drafter only): engine/speculative.py
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.arrival_time = time.monotonic()
        self.num_preemptions = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_pending(self) -> int:
        """Tokens the cache has not seen yet (what the next step(s) must feed)."""
        return len(self.token_ids) - self.num_computed

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed})")
