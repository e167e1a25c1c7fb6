"""Page ownership for both KV cache groups: reference counts, window release, prefix caching.

The model's `PagedKVCache` only provides storage here; this class decides which page ids a
sequence holds (`seq.pages[group]`, logical page i covers positions [i*ps, (i+1)*ps)).
- Full-attention pages are kept for the whole sequence; sliding-window pages are released as soon
  as every position on them is older than the next query can see (a query at p reads p-W+1 .. p).
- A page that becomes full is registered under a hash chain of the token ids up to its end, in
  both groups. Another sequence with the same prefix reuses those pages (refcount + 1) if the
  full-attention pages of the whole prefix AND the sliding pages covering the prefix's last window
  are still held or cached. Cached pages nobody references are evicted least-recently-used first.
- Page 0 of each pool is never handed out (padding writes there).
Must never hand out a page that is referenced, and never write a full page: shared pages are
always complete, and a sequence only writes pages it allocated itself.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict

from beam_model.config import FULL, SLIDING

GROUPS = (FULL, SLIDING)


def page_hash(parent: bytes, tokens: list[int]) -> bytes:
    """Hash of a full page given the hash of the page before it (b"" for the first)."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class _Pool:
    """One cache group's pages. `enabled=False` (a group with no layers) hands out page 0 forever."""

    def __init__(self, num_pages: int, enabled: bool = True):
        self.num_pages = num_pages
        self.enabled = enabled
        self.free = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first
        self.ref = [0] * num_pages
        self.hash_of: dict[int, bytes] = {}
        self.page_of: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached and unreferenced, LRU first

    @property
    def available(self) -> int:
        return len(self.free) + len(self.evictable) if self.enabled else 1 << 60

    @property
    def used(self) -> int:
        return self.num_pages - 1 - len(self.free) - len(self.evictable) if self.enabled else 0

    def take(self) -> int:
        if not self.enabled:
            return 0
        if self.free:
            p = self.free.pop()
        else:
            p, _ = self.evictable.popitem(last=False)
            del self.page_of[self.hash_of.pop(p)]
        self.ref[p] = 1
        return p

    def acquire(self, p: int) -> None:
        if not self.enabled:
            return
        if self.ref[p] == 0:
            del self.evictable[p]
        self.ref[p] += 1

    def release(self, p: int) -> None:
        if not self.enabled or p < 0:
            return
        self.ref[p] -= 1
        assert self.ref[p] >= 0, f"page {p} released more often than acquired"
        if self.ref[p] == 0:
            if p in self.hash_of:
                self.evictable[p] = None  # newest at the end: evicted last
            else:
                self.free.append(p)

    def register(self, p: int, h: bytes) -> None:
        # An identical page computed by another sequence may already be cached: keep that one.
        if self.enabled and h not in self.page_of and p not in self.hash_of:
            self.page_of[h] = p
            self.hash_of[p] = h

    def lookup(self, h: bytes) -> int | None:
        return self.page_of.get(h) if self.enabled else 0


class BlockManager:
    def __init__(self, num_pages: dict[str, int], *, page_size: int, window: int,
                 enabled: dict[str, bool] | None = None, prefix_caching: bool = True):
        enabled = enabled or {g: True for g in GROUPS}
        self.pools = {g: _Pool(num_pages[g], enabled[g]) for g in GROUPS}
        self.page_size = page_size
        self.window = window
        self.prefix_caching = prefix_caching

    # ---- accounting ----------------------------------------------------------------------
    def available(self, group: str) -> int:
        return self.pools[group].available

    def used(self, group: str) -> int:
        return self.pools[group].used

    def cached(self, group: str) -> int:
        return len(self.pools[group].evictable)

    def capacity(self, group: str) -> int:
        return self.pools[group].num_pages - 1

    def pages_needed(self, seq, num_new: int) -> dict[str, int]:
        total = math.ceil((seq.num_computed + num_new) / self.page_size)
        return {g: max(0, total - len(seq.pages[g])) if self.pools[g].enabled else 0 for g in GROUPS}

    def can_allocate(self, seq, num_new: int, reserve: int = 0) -> bool:
        need = self.pages_needed(seq, num_new)
        return all(need[g] <= self.pools[g].available - reserve for g in GROUPS)

    # ---- per-sequence verbs --------------------------------------------------------------
    def allocate(self, seq, num_new: int) -> None:
        """Give `seq` the pages its next `num_new` tokens write to (check can_allocate first)."""
        for g, n in self.pages_needed(seq, num_new).items():
            seq.pages[g].extend(self.pools[g].take() for _ in range(n))
        for g in GROUPS:  # a disabled group still mirrors the logical page count
            while len(seq.pages[g]) < len(seq.pages[FULL]):
                seq.pages[g].append(0)

    def release_window(self, seq) -> None:
        """Drop sliding pages no future query of `seq` can see (next query at `num_computed`)."""
        first_visible = seq.num_computed - self.window + 1
        pages, pool = seq.pages[SLIDING], self.pools[SLIDING]
        for i, p in enumerate(pages):
            if (i + 1) * self.page_size > first_visible:
                break
            if p >= 0:
                pool.release(p)
                pages[i] = -1

    def trim(self, seq) -> None:
        """Release `seq`'s pages past its progress: those only drafts it did not keep wrote to."""
        keep = math.ceil(seq.num_computed / self.page_size)
        for g in GROUPS:
            pages = seq.pages[g]
            while len(pages) > keep:
                self.pools[g].release(pages.pop())

    def commit(self, seq) -> None:
        """After a step: hash the pages it completed and offer them to the prefix cache. A page is hashed
        once its tokens are all in `seq.token_ids` too: a verify step computes kept drafts before the engine
        appends them."""
        ps = self.page_size
        while len(seq.page_hashes) < min(seq.num_computed, seq.num_tokens) // ps:
            i = len(seq.page_hashes)
            h = page_hash(seq.page_hashes[-1] if i else b"", seq.token_ids[i * ps:(i + 1) * ps])
            seq.page_hashes.append(h)
            if self.prefix_caching:
                for g in GROUPS:
                    if seq.pages[g][i] >= 0:
                        self.pools[g].register(seq.pages[g][i], h)

    def match_prefix(self, seq) -> int:
        """Attach the longest reusable cached prefix to a sequence without pages; returns its tokens.

        At least one token is always left to compute (its logits are needed)."""
        assert not seq.pages[FULL] and seq.num_computed == 0
        if not self.prefix_caching:
            return 0
        ps, full, sliding = self.page_size, self.pools[FULL], self.pools[SLIDING]
        hashes: list[bytes] = []
        for i in range((seq.num_tokens - 1) // ps):
            h = page_hash(hashes[-1] if hashes else b"", seq.token_ids[i * ps:(i + 1) * ps])
            if full.lookup(h) is None:
                break
            hashes.append(h)
        k = len(hashes)
        while k > 0:  # the sliding pages of the last window before position k*ps must be there too
            lo = max(0, k * ps - self.window + 1) // ps
            if all(sliding.lookup(hashes[i]) is not None for i in range(lo, k)):
                break
            k -= 1
        if k == 0:
            return 0
        lo = max(0, k * ps - self.window + 1) // ps
        for i in range(k):
            p = full.lookup(hashes[i])
            full.acquire(p)
            seq.pages[FULL].append(p)
            if i < lo:
                seq.pages[SLIDING].append(-1)
            else:
                p = sliding.lookup(hashes[i])
                sliding.acquire(p)
                seq.pages[SLIDING].append(p)
        seq.page_hashes = hashes[:k]
        seq.num_computed = k * ps
        return k * ps

    def free(self, seq) -> None:
        """Return every page of `seq` (cached ones stay reusable until evicted) and forget its progress."""
        for g in GROUPS:
            for p in seq.pages[g]:
                self.pools[g].release(p)
            seq.pages[g] = []
        seq.page_hashes = []
        seq.num_computed = 0
