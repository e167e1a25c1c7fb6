"""Incremental detokenization with stop strings, one instance per request.

Turns each generated id into the text that can be released now: held back while a multi-byte
character is incomplete (the tokenizer's StreamDecoder) or while the tail could still be the start
of a stop string (stop strings can span token boundaries). A found stop string ends the request
and neither it nor anything after it is ever released. Must never release text it may have to
take back.
"""

from __future__ import annotations


def _held_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = min(len(text), max(len(s) for s in stops) - 1)
    for k in range(longest, 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops):
            return k
    return 0


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self._decoder = tokenizer.stream_decoder()
        self._stop = tuple(stop)
        self._pending = ""   # decoded but not yet released (could begin a stop string)
        self.stopped = False  # a stop string was found

    def add(self, token_id: int) -> str:
        """Feed one generated id; returns the text released by it."""
        if self.stopped:
            return ""
        self._pending += self._decoder.feed(token_id)
        return self._release()

    def flush(self) -> str:
        """At the end of generation: release whatever was held back (no stop string can complete now)."""
        if self.stopped:
            return ""
        self._pending += self._decoder.finish()
        out = self._release()
        if not self.stopped:
            out, self._pending = out + self._pending, ""
        return out

    def _release(self) -> str:
        if not self._stop:
            out, self._pending = self._pending, ""
            return out
        hits = [i for i in (self._pending.find(s) for s in self._stop) if i >= 0]
        if hits:
            self.stopped = True
            out, self._pending = self._pending[:min(hits)], ""
            return out
        keep = _held_suffix(self._pending, self._stop)
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out
