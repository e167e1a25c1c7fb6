"""Runs one scheduled step on the model: builds the ragged inputs and page tables, calls
`model.step`, and samples the next token of every sequence whose pending tokens are all fed.

Owns the KV storage (`PagedKVCache`, used as storage only: pages are the block manager's) and,
on CUDA with `cuda_graphs=True`, one captured graph per decode batch size: a decode step is padded
to the next captured size, padded tokens write to the reserved page 0 and read nothing live. Prefill
or mixed steps, and decode steps wider than the captured page tables, run eagerly. The CPU never
uses graphs. Must never change a sequence's tokens, pages or progress: the engine applies the
results (the one thing it sets is a seeded request's generator, on first use).
"""

from __future__ import annotations

import math
import time

import torch

from beam_model.config import FULL, SLIDING
from beam_model.kv_cache import AttentionMetadata, PagedKVCache, StepMetadata, build_step_metadata
from server.engine.block_manager import GROUPS
from server.engine.graph_inputs import GraphInputs
from server.engine.output import TokenLogprob

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
# The reference experts group tokens by expert (a host sync, not capturable) above 256 tokens.
MAX_GRAPH_BATCH = 256


class ModelRunner:
    def __init__(self, model, num_pages: dict[str, int], *, page_size: int, max_num_seqs: int,
                 vocab_limit: int | None = None, cuda_graphs: bool = False, graph_max_len: int = 8192,
                 seed: int = 0, logits_hook=None):
        self.model = model
        self.device = model.device
        self.page_size = page_size
        self.cache = PagedKVCache(model.config, num_pages[FULL], num_sliding_pages=num_pages[SLIDING],
                                  dtype=model.dtype, device=self.device, page_size=page_size)
        # Ids the tokenizer cannot decode (the model's vocab is padded) are never sampled.
        self.vocab_limit = vocab_limit if vocab_limit is not None else model.config.vocab_size
        self.generator = torch.Generator(device=self.device).manual_seed(seed)  # unseeded requests
        self.logits_hook = logits_hook  # test-only: see server/engine/testing.py
        self.graphs: dict[int, tuple] = {}
        self.last_prepare_seconds = 0.0  # host time of the last run before its forward was launched
        # GPU time of the last run from its forward's launch to its sampled tokens' copy (CUDA events;
        # None on the CPU, and for a run that samples nothing, which is not waited for)
        self.last_device_seconds = None
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) \
            if self.device.type == "cuda" else None
        if cuda_graphs and self.device.type == "cuda":
            top = min(max_num_seqs, MAX_GRAPH_BATCH)
            sizes = sorted({b for b in GRAPH_BATCH_SIZES if b < top} | {top})
            self._capture(sizes, math.ceil(graph_max_len / page_size))

    # ---- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, seqs: list, counts: list[int]) -> list[TokenLogprob | None]:
        """Feed `counts[i]` pending tokens of `seqs[i]`; returns the sampled token of each sequence
        that has now fed all its pending tokens (None for a sequence mid-prompt)."""
        started = time.perf_counter()
        self.last_device_seconds = None
        starts = [s.num_computed for s in seqs]
        ids = [t for s, c, n in zip(seqs, starts, counts) for t in s.token_ids[c:c + n]]
        pages = {g: [s.pages[g] for s in seqs] for g in GROUPS}
        rows = [i for i, (s, c, n) in enumerate(zip(seqs, starts, counts)) if c + n == s.num_tokens]
        params = self._sampling_params([seqs[i] for i in rows]) if rows else None
        graph = self._graph_for(pages) if all(n == 1 for n in counts) else None
        if graph is not None:
            logits = self._replay(graph, ids, pages, starts, started)
        else:
            step = build_step_metadata(pages, starts, counts, page_size=self.page_size, device=self.device)
            ids = torch.tensor(ids, device=self.device)
            self.last_prepare_seconds = time.perf_counter() - started
            self._mark(0)
            logits = self.model.step(ids, self.cache, step)
        results: list[TokenLogprob | None] = [None] * len(seqs)
        if rows:
            for i, r in zip(rows, self._sample([seqs[i] for i in rows], logits[rows], params)):
                results[i] = r
        return results

    def _sampling_params(self, seqs: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each sampled row's temperature, top_k and top_p on the device, copied before the forward is
        launched and without waiting: made after it, from pageable memory, each copy would wait for the
        whole forward and leave the device idle between the sampling's small launches."""
        host = (torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32),
                torch.tensor([s.params.top_k for s in seqs], dtype=torch.int64),
                torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32))
        if self.device.type != "cuda":
            return host
        # pinned (the caching host allocator keeps each block until its copy is done) and asynchronous
        return tuple(t.pin_memory().to(self.device, non_blocking=True) for t in host)

    def _sample(self, seqs: list, logits: torch.Tensor, params) -> list[TokenLogprob]:
        logits = logits.float()  # a copy (indexing above), so in-place edits never touch graph outputs
        if self.vocab_limit < logits.shape[-1]:
            logits[:, self.vocab_limit:] = float("-inf")
        if self.logits_hook is not None:
            self.logits_hook(seqs, logits)
        dev, n = self.device, len(seqs)
        temperature, top_k, top_p = params
        sample = self.model.ops.sample
        ids = torch.empty(n, dtype=torch.int64, device=dev)
        seeded = [i for i, s in enumerate(seqs) if s.params.seed is not None and not s.params.greedy]
        shared = sorted(set(range(n)) - set(seeded))
        if len(shared) == n:  # the usual step: every row draws from the engine's generator, no gather
            ids = sample(logits, temperature, top_k, top_p, generator=self.generator)
        elif shared:  # greedy and unseeded rows: one batched draw from the engine's generator
            idx = torch.tensor(shared, device=dev)
            ids[idx] = sample(logits[idx], temperature[idx], top_k[idx], top_p[idx], generator=self.generator)
        for i in seeded:  # a row of its own with its own generator: reproducible whatever the batch
            s = seqs[i]
            if s.generator is None:
                s.generator = torch.Generator(device=dev).manual_seed(s.params.seed)
            ids[i:i + 1] = sample(logits[i:i + 1], temperature[i:i + 1], top_k[i:i + 1], top_p[i:i + 1],
                                  generator=s.generator)
        self._mark(1)
        chosen = ids.tolist()  # waits for the forward and the draw
        if self._events is not None:
            self.last_device_seconds = self._events[0].elapsed_time(self._events[1]) / 1e3
        out = [TokenLogprob(t, 0.0) for t in chosen]
        want = [i for i, s in enumerate(seqs) if s.params.logprobs]
        if want:
            lp = logits[want].log_softmax(-1)
            k = max(seqs[i].params.top_logprobs for i in want)
            top_v, top_i = lp.topk(max(k, 1), dim=-1)
            picked = lp.gather(1, ids[want][:, None])[:, 0].tolist()
            top_v, top_i = top_v.tolist(), top_i.tolist()
            for j, i in enumerate(want):
                kk = seqs[i].params.top_logprobs
                out[i] = TokenLogprob(chosen[i], picked[j], list(zip(top_i[j][:kk], top_v[j][:kk])))
        return out

    # ---- CUDA graphs -----------------------------------------------------------------------
    def _capture(self, sizes: list[int], max_pages: int) -> None:
        dev, big = self.device, max(sizes)
        self._inputs = GraphInputs(big, max_pages, GROUPS, dev)  # what `_replay` refills
        self._qstart = torch.arange(big + 1, dtype=torch.int32, device=dev)
        self._last = torch.arange(big, dtype=torch.int64, device=dev)
        pool = None
        with torch.inference_mode():
            for b in sorted(sizes, reverse=True):  # largest first so the others share its memory pool
                meta = self._graph_metadata(b)
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # warm-up outside capture (lazy inits, autotuning)
                    self.model.step(self._inputs.ids[:b], self.cache, meta)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model.step(self._inputs.ids[:b], self.cache, meta)
                pool = graph.pool()
                self.graphs[b] = (graph, out, meta)  # the metadata lives as long as its graph
        torch.cuda.synchronize()

    def _graph_metadata(self, b: int) -> StepMetadata:
        x = self._inputs
        common = dict(positions=x.pos[:b], seq_lens=x.lens[:b], query_start=self._qstart[:b + 1],
                      page_size=self.page_size, decode=True, query_start_host=list(range(b + 1)),
                      seq_lens_host=[1] * b)
        groups = {g: AttentionMetadata(page_table=x.tables[g][:b], slot_mapping=x.slots[g][:b], **common)
                  for g in GROUPS}
        return StepMetadata(groups=groups, positions=x.pos[:b], last_token_index=self._last[:b], num_tokens=b)

    def _graph_for(self, pages: dict[str, list[list[int]]]):
        b = len(pages[FULL])
        if not self.graphs or b > max(self.graphs) or max(map(len, pages[FULL])) > self._inputs.max_pages:
            return None
        return min(size for size in self.graphs if size >= b)

    def _replay(self, size: int, ids: list[int], pages, starts: list[int], started: float) -> torch.Tensor:
        b = len(ids)
        lens = self._inputs.fill(size, ids, starts, pages, self.page_size)
        graph, out, meta = self.graphs[size]
        for g in GROUPS:  # host copies of the layout, for variants that plan on the host
            meta.groups[g].seq_lens_host[:] = lens
        self.model.replan(meta)
        self.last_prepare_seconds = time.perf_counter() - started
        self._mark(0)
        graph.replay()
        return out[:b]

    def _mark(self, i: int) -> None:
        """Record device-time event `i` (0: forward launched, 1: tokens drawn) on the current stream."""
        if self._events is not None:
            self._events[i].record()
