"""Paged KV cache: pages of 64 tokens in FlashInfer's paged NHD layout, one page table per sequence.

Storage per layer is `[pages, 2, page_size, kv_heads, head_dim]` (K at index 0, V at 1), the layout
FlashInfer's paged wrappers take. Full-attention and sliding-window layers live in separate cache
groups with their own page pools: a full layer keeps every page of a sequence, a sliding-window
layer only the pages that still hold one of the last `window` positions, so its pages go back to
the pool as the sequence grows. Page 0 of each pool is never handed out: padded tokens of a
captured batch can write there without touching a live sequence.

Prefill (many tokens per sequence) and decode (one token per sequence) use the same call:
`prepare_step(seq_ids, num_new_tokens)` allocates the pages the new tokens need (all or nothing),
advances the lengths and returns the step's `StepMetadata`. This module does bookkeeping only; it
never computes attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from beam_model.config import FULL, SLIDING, BeamConfig

PAGE_SIZE = 64
GROUPS = (FULL, SLIDING)


class CacheFull(RuntimeError):
    """Not enough free pages for a step; nothing was allocated."""


@dataclass
class AttentionMetadata:
    """One cache group's view of a step. Device tensors plus host copies of the ragged layout."""

    positions: torch.Tensor      # [N] int64, absolute 0-based position of each new token
    seq_lens: torch.Tensor       # [B] int32, KV length of each sequence after this step
    query_start: torch.Tensor    # [B+1] int32, offsets of each sequence's tokens in the step
    page_table: torch.Tensor     # [B, max_pages] int32, logical page -> page id, -1 if none
    slot_mapping: torch.Tensor   # [N] int64, where each new token's K/V goes (page * size + offset)
    page_size: int
    decode: bool                 # every sequence has exactly one new token
    query_start_host: list[int]
    seq_lens_host: list[int]


@dataclass
class StepMetadata:
    groups: dict[str, AttentionMetadata]
    positions: torch.Tensor      # [N] int64
    last_token_index: torch.Tensor  # [B] int64, each sequence's last new token (where logits are read)
    num_tokens: int


@dataclass
class _Sequence:
    length: int = 0
    pages: dict[str, list[int]] = field(default_factory=lambda: {g: [] for g in GROUPS})


class PagedKVCache:
    def __init__(self, config: BeamConfig, num_pages: int, *, num_sliding_pages: int | None = None,
                 dtype=torch.bfloat16, device=None, page_size: int = PAGE_SIZE, release_window: bool = True):
        self.config = config
        self.page_size = page_size
        self.window = config.sliding_window
        self.release_window = release_window
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        pool_sizes = {FULL: num_pages, SLIDING: num_sliding_pages if num_sliding_pages is not None else num_pages}
        self.group_of_layer = list(config.layer_types)
        self.layers_of = {g: [i for i, t in enumerate(config.layer_types) if t == g] for g in GROUPS}
        self._slot_in_group = {i: self.layers_of[t].index(i) for i, t in enumerate(config.layer_types)}
        self.storage: dict[str, torch.Tensor] = {}
        self.num_pages: dict[str, int] = {}
        self._free: dict[str, list[int]] = {}
        for g in GROUPS:
            n = pool_sizes[g]  # a group with no layers still hands out pages (its storage holds no bytes)
            if n < 2:
                raise ValueError(f"cache group {g} needs at least 2 pages (page 0 is reserved), got {n}")
            shape = (len(self.layers_of[g]), n, 2, page_size, config.num_key_value_heads, config.head_dim)
            self.storage[g] = torch.zeros(shape, dtype=dtype, device=self.device)
            self.num_pages[g] = n
            self._free[g] = list(range(n - 1, 0, -1))  # pop() hands out low ids first
        self._seqs: dict[object, _Sequence] = {}

    @classmethod
    def for_sequences(cls, config: BeamConfig, lengths: list[int], **kw) -> "PagedKVCache":
        """A cache just large enough for the given sequence lengths (plus the reserved page)."""
        pages = sum(math.ceil(n / kw.get("page_size", PAGE_SIZE)) for n in lengths) + 1
        return cls(config, pages, **kw)

    # ---- storage -------------------------------------------------------------------------
    def layer(self, i: int) -> torch.Tensor:
        """Layer i's cache, [pages, 2, page_size, kv_heads, head_dim]."""
        return self.storage[self.group_of_layer[i]][self._slot_in_group[i]]

    def free_pages(self, group: str) -> int:
        return len(self._free[group])

    def used_pages(self, group: str) -> int:
        return self.num_pages[group] - 1 - len(self._free[group])

    # ---- sequences -----------------------------------------------------------------------
    def add(self, seq_id) -> None:
        if seq_id in self._seqs:
            raise KeyError(f"sequence {seq_id!r} is already in the cache")
        self._seqs[seq_id] = _Sequence()

    def free(self, seq_id) -> None:
        seq = self._seqs.pop(seq_id)
        for g in GROUPS:
            self._free[g].extend(p for p in reversed(seq.pages[g]) if p >= 0)

    def length(self, seq_id) -> int:
        return self._seqs[seq_id].length

    def pages(self, seq_id, group: str) -> list[int]:
        return list(self._seqs[seq_id].pages[group])

    def _release_out_of_window(self, seq: _Sequence) -> None:
        """Free sliding-window pages whose every position is older than the next query can see."""
        first_visible = seq.length - self.window + 1  # the next query sits at position `length`
        pages = seq.pages[SLIDING]
        for i, p in enumerate(pages):
            if p >= 0 and (i + 1) * self.page_size <= first_visible:
                self._free[SLIDING].append(p)
                pages[i] = -1

    def prepare_step(self, seq_ids: list, num_new_tokens: list[int], *, max_pages: int | None = None) -> StepMetadata:
        """Allocate pages for the new tokens of each sequence (all or nothing) and describe the step."""
        if len(seq_ids) != len(num_new_tokens) or not seq_ids:
            raise ValueError("prepare_step needs one token count per sequence and at least one sequence")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("a sequence appears twice in one step")
        if any(n < 1 for n in num_new_tokens):
            raise ValueError("every sequence in a step needs at least one new token")
        seqs = [self._seqs[s] for s in seq_ids]
        if self.release_window:
            for seq in seqs:
                self._release_out_of_window(seq)
        ps = self.page_size
        need = {g: 0 for g in GROUPS}
        for seq, n in zip(seqs, num_new_tokens):
            for g in GROUPS:
                need[g] += max(0, math.ceil((seq.length + n) / ps) - len(seq.pages[g]))
        for g in GROUPS:
            if self.layers_of[g] and need[g] > len(self._free[g]):
                raise CacheFull(f"{g} cache group needs {need[g]} pages, {len(self._free[g])} free")
        width = max(max(len(seq.pages[FULL]), math.ceil((seq.length + n) / ps))
                    for seq, n in zip(seqs, num_new_tokens))
        if max_pages is not None and max_pages < width:  # checked before anything is taken
            raise ValueError(f"max_pages={max_pages} is smaller than the {width} pages a sequence needs")
        for seq, n in zip(seqs, num_new_tokens):
            for g in GROUPS:
                while len(seq.pages[g]) * ps < seq.length + n:
                    seq.pages[g].append(self._free[g].pop() if self.layers_of[g] else 0)
        starts = [seq.length for seq in seqs]
        for seq, n in zip(seqs, num_new_tokens):
            seq.length += n
        return self._metadata(seqs, starts, num_new_tokens, max_pages)

    def _metadata(self, seqs, starts, counts, max_pages) -> StepMetadata:
        pages = {g: [seq.pages[g] for seq in seqs] for g in GROUPS}
        return build_step_metadata(pages, starts, counts, page_size=self.page_size, device=self.device,
                                   max_pages=max_pages)


def build_step_metadata(pages: dict[str, list[list[int]]], starts: list[int], counts: list[int], *,
                        page_size: int, device, max_pages: int | None = None) -> StepMetadata:
    """Describe a step from each sequence's page list per group (-1 = released), its KV length
    before the step and its number of new tokens. Whoever owns the pages (this cache, or a
    server's block manager with prefix sharing) calls this; it allocates nothing."""
    ps, dev = page_size, device
    positions = [p for s, n in zip(starts, counts) for p in range(s, s + n)]
    query_start = [0]
    for n in counts:
        query_start.append(query_start[-1] + n)
    seq_lens = [s + n for s, n in zip(starts, counts)]
    width = max(len(p) for p in pages[FULL])
    if max_pages is not None:
        if max_pages < width:
            raise ValueError(f"max_pages={max_pages} is smaller than the {width} pages a sequence needs")
        width = max_pages
    pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
    common = dict(
        positions=pos_t,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        query_start=torch.tensor(query_start, dtype=torch.int32, device=dev),
        page_size=ps, decode=all(n == 1 for n in counts),
        query_start_host=query_start, seq_lens_host=seq_lens,
    )
    groups = {}
    for g in GROUPS:
        table = [p + [-1] * (width - len(p)) for p in pages[g]]
        slots = [p[t // ps] * ps + t % ps for p, s, n in zip(pages[g], starts, counts) for t in range(s, s + n)]
        groups[g] = AttentionMetadata(
            page_table=torch.tensor(table, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev), **common)
    last = torch.tensor(query_start[1:], dtype=torch.int64, device=dev) - 1
    return StepMetadata(groups=groups, positions=pos_t, last_token_index=last, num_tokens=len(positions))
