"""Continuous batching: which sequences run this step, and how many tokens each feeds.

Every step has a token budget (`max_num_batched_tokens`) shared by decode tokens (one per running
sequence) and chunks of prompts (chunked prefill), so requests join and leave at any step.
Running sequences go first (decode tokens before prompt chunks, oldest first); waiting ones are
admitted only while the budget, the sequence limit and the free pages allow. When a running
sequence needs a page and none is free, the newest running sequence is preempted: its pages go
back (recompute later, its cached pages likely reused). The scheduler never raises for lack of
pages: a sequence that cannot grow even alone is finished with "length".
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from server.engine.block_manager import BlockManager
from server.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)     # tokens each sequence feeds this step
    finished: list[Sequence] = field(default_factory=list)  # ended by the scheduler (no room to grow)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        # (sequence, the step's token budget left) -> how many drafts a decoding sequence feeds after its
        # last token (the engine sets it when a drafter is loaded: engine/speculative.py)
        self.drafts_for = lambda seq, budget: 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a sequence out (finished or aborted) and give its pages back at once."""
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        elif seq.status == Status.WAITING:
            self.waiting.remove(seq)
        self.bm.free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)  # first in line again: it was admitted before the others

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        # Decode tokens first (inter-token latency), then prompt chunks, oldest first within each.
        order = [s for s in self.running if s.num_pending == 1] + [s for s in self.running if s.num_pending > 1]
        for seq in order:
            if budget == 0:
                break
            if seq.status != Status.RUNNING:  # preempted above to make room for an older one
                continue
            n = min(seq.num_pending, budget)
            self.bm.release_window(seq)
            if seq.num_pending == 1:  # drafts only where the pool has room for them as it is
                drafts = self.drafts_for(seq, budget)
                n += drafts if drafts and self.bm.can_allocate(seq, n + drafts) else 0
            while not self.bm.can_allocate(seq, n):
                victim = next((v for v in reversed(self.running) if v is not seq and v not in batch.seqs), None)
                if victim is None:
                    break
                self._preempt(victim)
                preempted = True
            if self.bm.can_allocate(seq, n):
                self.bm.allocate(seq, n)
                batch.seqs.append(seq)
                batch.num_tokens.append(n)
                budget -= n
            elif len(self.running) == 1:  # alone and still no room: the pool cannot hold it any longer
                self.finish(seq, "length")
                batch.finished.append(seq)
            else:  # the others in this step hold the pages: retry after them
                self._preempt(seq)
                preempted = True
        if preempted:  # admitting now would only preempt again next step
            return batch
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hit = self.bm.match_prefix(seq)
            n = min(seq.num_pending, budget)
            # Leave a page per running sequence so admissions don't immediately force preemptions.
            if not self.bm.can_allocate(seq, n, reserve=len(self.running)):
                self.bm.free(seq)  # let go of the matched prefix; try again next step
                if not self.running:  # the whole pool would not do: never wait forever
                    self.finish(seq, "length")
                    batch.finished.append(seq)
                    continue
                break
            if seq.num_cached_tokens is None:  # first admission: this is the prompt's cache hit
                seq.num_cached_tokens = hit
                self.prefix_queried_tokens += seq.num_prompt_tokens
                self.prefix_hit_tokens += hit
            self.bm.allocate(seq, n)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
        return batch
