"""The token masks of a step's sampled rows, from the host's grammar matchers to the device.

One pinned host buffer and one device buffer of `rows` x ceil(V/32) int32 words (the `sample`
contract's `allowed`). A row without a grammar is all ones. `fill` runs while the device computes the
step's logits (the forward is already launched), then starts one copy; the device buffer is the
decode graphs' mask input, so a graph samples under the masks of its step. Must never wait for the
device: the copy is ordered on the current stream, before the draw that reads it.
"""

from __future__ import annotations

import time

import torch

from server.engine.grammar import mask_words


class TokenMasks:
    def __init__(self, rows: int, vocab_size: int, device: torch.device):
        words = mask_words(vocab_size)
        cuda = device.type == "cuda"
        self._host = torch.full((rows, words), -1, dtype=torch.int32, pin_memory=cuda)
        self.device_buffer = torch.full((rows, words), -1, dtype=torch.int32, device=device)
        self._dirty = 0  # rows of the device buffer that may hold a grammar's mask (the rest are all ones)
        self.last_seconds = 0.0  # host time of the last fill (grammar work included)
        self.last_constrained = 0  # rows of the last fill that had a grammar

    def fill(self, grammars, seqs: list, *, always: bool = False) -> torch.Tensor | None:
        """The masks of `seqs` (row i: seqs[i]) as device rows [len(seqs), words]; None when no row has a
        grammar, unless `always` (a graph reads the buffer whatever the step)."""
        started = time.perf_counter()
        n = len(seqs)
        rows = [(i, s.matcher) for i, s in enumerate(seqs) if s.matcher is not None]
        if rows:
            host = self._host[:n]
            host.fill_(-1)
            grammars.fill(rows, host)
            self.device_buffer[:n].copy_(host, non_blocking=True)
            self._dirty = max(self._dirty, n)
        elif self._dirty and always:
            self.device_buffer[:self._dirty].fill_(-1)
            self._dirty = 0
        self.last_seconds, self.last_constrained = time.perf_counter() - started, len(rows)
        return self.device_buffer[:n] if rows or always else None
