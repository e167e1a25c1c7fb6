"""`thinking_token_budget`: the reasoning closes once it has used its tokens, never inside a character.

A request's budget counts the tokens between `<|think|>` and `<|/think|>`. While tokens remain, a
token that would leave a UTF-8 character unfinished with fewer tokens left than the character still
needs is masked out (one byte a token is the most the budget may have to spend on finishing it); once
none remain, the mask allows only `<|/think|>`. So the reasoning is at most the budget in tokens and
always whole characters, whatever the vocabulary (byte tokens, or byte-level BPE tokens that split a
character). The grammar keeps every other rule; this only narrows its mask.
"""

from __future__ import annotations

import numpy as np
import torch

from workbench.variants.sample import pack_allowed


def _pending_after(pending: int, data: bytes) -> int:
    """Continuation bytes still owed to the current UTF-8 character after `data`."""
    for b in data:
        if 0x80 <= b < 0xC0:
            pending = max(pending - 1, 0)
        else:
            pending = 3 if b >= 0xF0 else 2 if b >= 0xE0 else 1 if b >= 0xC0 else 0
    return pending


class Utf8Tails:
    """Per token of the vocabulary: what its bytes leave owed of a character."""

    def __init__(self, token_bytes: list[bytes]):
        self.token_bytes = token_bytes
        # a token with a lead (or ASCII) byte sets what is owed itself; one of only continuation bytes pays
        self.tail = np.array([_pending_after(0, t) for t in token_bytes], dtype=np.int16)
        self.continuation_only = np.array([all(0x80 <= b < 0xC0 for b in t) for t in token_bytes], dtype=bool)
        self.length = np.array([len(t) for t in token_bytes], dtype=np.int16)

    def owed_after(self, pending: int) -> np.ndarray:
        """[V] continuation bytes owed after each token, from `pending` owed before it."""
        return np.where(self.continuation_only, np.maximum(pending - self.length, 0), self.tail)



class ReasoningBudget:
    """One request's budget: follows its tokens (`accept`) and narrows its mask row (`restrict`)."""

    def __init__(self, limit: int, think_id: int, end_think_id: int, tails: Utf8Tails):
        self.limit, self.think_id, self.end_think_id, self.tails = limit, think_id, end_think_id, tails
        self.inside, self.used, self.pending = False, 0, 0

    def accept(self, token_id: int) -> None:
        if token_id == self.think_id:
            self.inside, self.used, self.pending = True, 0, 0
        elif token_id == self.end_think_id:
            self.inside = False
        elif self.inside:
            self.used += 1
            self.pending = _pending_after(self.pending, self.tails.token_bytes[token_id])

    def restrict(self, row: torch.Tensor) -> None:
        """Narrow one mask row (host int32 words) in place; nothing outside the reasoning."""
        if not self.inside:
            return
        left = self.limit - self.used
        if left <= 0:
            word = 1 << (self.end_think_id % 32)
            row.zero_()
            row[self.end_think_id // 32] = word - (1 << 32) if word >= 1 << 31 else word  # int32 bits
            return
        row &= pack_allowed(torch.from_numpy(self.tails.owed_after(self.pending) <= left - 1)[None])[0]
