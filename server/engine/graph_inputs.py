"""The inputs a captured decode graph reads, refilled for each replay by three copies.

A graph reads its inputs at fixed device addresses: the runner writes each step's tokens,
positions, lengths, cache slots, page tables and each row's sampling settings there before
replaying it. Built as a tensor each and copied one by one, they cost host time every step while
the device waits (the serving sweep's "host prepare", `runs/serve-host-overhead-tp8-b1/`). Here
they are typed views of one device buffer, mirrored by one pinned host buffer that numpy fills: the
small inputs go in one copy, each group's page table in one more, of the rows in use only.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from beam_model.kv_cache import AttentionMetadata, StepMetadata

# A padded row's sampling settings: greedy, no filter.
PAD_SAMPLING = (0.0, 0, 1.0)


class GraphInputs:
    """Device views `ids`, `pos`, `lens`, `slots[g]`, `tables[g]` and the sampling settings
    `temperature`, `top_k`, `top_p` over `rows` rows (the largest graph), `tables[g]` [rows, max_pages]
    int32; `fill` writes a step's values for the first `size` rows."""

    def __init__(self, rows: int, max_pages: int, groups, device: torch.device):
        self.max_pages, self.groups = max_pages, tuple(groups)
        # 8-byte arrays first, so every view is aligned: ids, pos, top_k, slots per group, then lens,
        # temperature, top_p, tables
        layout = [("ids", torch.int64, (rows,)), ("pos", torch.int64, (rows,)), ("top_k", torch.int64, (rows,))] + \
            [(("slots", g), torch.int64, (rows,)) for g in self.groups] + \
            [(name, dtype, (rows,)) for name, dtype in (("lens", torch.int32), ("temperature", torch.float32),
                                                        ("top_p", torch.float32))] + \
            [(("tables", g), torch.int32, (rows, max_pages)) for g in self.groups]
        spans, at = {}, 0
        for name, dtype, shape in layout:
            nbytes = dtype.itemsize * int(np.prod(shape))
            spans[name] = (at, nbytes, dtype, shape)
            at += nbytes
        cuda = device.type == "cuda"
        self._host = torch.zeros(at, dtype=torch.uint8, pin_memory=cuda)
        self._device = torch.zeros(at, dtype=torch.uint8, device=device)
        self._copied = torch.cuda.Event() if cuda else None

        def view(buffer, name):
            start, nbytes, dtype, shape = spans[name]
            return buffer[start:start + nbytes].view(dtype).view(shape)

        self._h = {name: view(self._host, name).numpy() for name in spans}
        self.ids, self.pos, self.lens = (view(self._device, name) for name in ("ids", "pos", "lens"))
        self.temperature, self.top_k, self.top_p = (view(self._device, n) for n in ("temperature", "top_k", "top_p"))
        self.slots = {g: view(self._device, ("slots", g)) for g in self.groups}
        self.tables = {g: view(self._device, ("tables", g)) for g in self.groups}
        self._table_at = {g: spans[("tables", g)][0] for g in self.groups}
        self._small_bytes = min(self._table_at.values())  # the small inputs end where the page tables begin
        self._query_start = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self._last = torch.arange(rows, dtype=torch.int64, device=device)
        self._h["lens"][:] = 1  # every row, padding included, sees at least its own token
        self._h["temperature"][:], self._h["top_k"][:], self._h["top_p"][:] = PAD_SAMPLING
        self._device.copy_(self._host)

    def fill(self, size: int, ids: list[int], starts: list[int], pages: dict, page_size: int,
             sampling: list[tuple[float, int, float]] | None = None) -> list[int]:
        """Rows 0..len(ids)-1 get this step's token, position (`starts`), length, sampling settings
        ((temperature, top_k, top_p) a row; None: PAD_SAMPLING) and, per group, page table and the cache
        slot of the token; rows up to `size` are padding: token 0 at position 0 writing slot 0 of the
        reserved page 0 and reading only it, drawn greedily. Starts the copies (on the current stream)
        and returns the lengths of the `size` rows."""
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have read the host buffer
        h, b = self._h, len(ids)
        h["ids"][:size], h["pos"][:size], h["lens"][:size] = 0, 0, 1
        h["ids"][:b], h["pos"][:b] = ids, starts
        h["lens"][:b] = np.asarray(starts) + 1
        h["temperature"][:size], h["top_k"][:size], h["top_p"][:size] = PAD_SAMPLING
        if sampling:
            h["temperature"][:b], h["top_k"][:b], h["top_p"][:b] = zip(*sampling)
        positions = np.asarray(starts)
        for g in self.groups:
            table, slots, rows = h[("tables", g)], h[("slots", g)], pages[g]
            table[:size] = 0
            slots[:size] = 0
            # a run of rows holding one page table (a verify step's block) in one assignment
            for _, run in itertools.groupby(range(b), key=lambda r: id(rows[r])):
                run = list(run)
                start, end = run[0], run[-1] + 1
                row = np.asarray(rows[start])
                table[start:end, :len(row)] = row
                at = positions[start:end]
                slots[start:end] = row[at // page_size] * page_size + at % page_size
        self._upload(0, self._small_bytes)
        for g in self.groups:
            self._upload(self._table_at[g], 4 * size * self.max_pages)
        if self._copied is not None:
            self._copied.record()
        return h["lens"][:size].tolist()

    def metadata(self, rows: int, page_size: int, lens: list[int] | None = None) -> StepMetadata:
        """A decode step's metadata over the first `rows` rows, viewing these buffers (a graph captured
        with it reads each `fill`); `lens`: the host copy of the rows' lengths (default 1 each, refilled
        before a replay)."""
        common = dict(positions=self.pos[:rows], seq_lens=self.lens[:rows], query_start=self._query_start[:rows + 1],
                      page_size=page_size, decode=True, query_start_host=list(range(rows + 1)),
                      seq_lens_host=list(lens) if lens is not None else [1] * rows)
        groups = {g: AttentionMetadata(page_table=self.tables[g][:rows], slot_mapping=self.slots[g][:rows], **common)
                  for g in self.groups}
        return StepMetadata(groups=groups, positions=self.pos[:rows], last_token_index=self._last[:rows],
                            num_tokens=rows)

    def _upload(self, at: int, nbytes: int) -> None:
        self._device[at:at + nbytes].copy_(self._host[at:at + nbytes], non_blocking=True)
