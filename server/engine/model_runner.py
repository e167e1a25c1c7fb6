"""Runs one scheduled step on the model: builds the ragged inputs and page tables, calls
`model.step`, and samples the next token of every sequence whose pending tokens are all fed.

Owns the KV storage (`PagedKVCache`, used as storage only: pages are the block manager's) and,
on CUDA with `cuda_graphs=True`, two captured graphs per decode batch size: a decode step is padded
to the next captured size, padded tokens write to the reserved page 0 and read nothing live. The
forward's graph is launched first; while it runs, the host fills the rows' grammar masks (only rows
with a grammar: `TokenMasks`); then the draw's graph takes each row's token (the `sample` op on the
engine's generator, each row's settings from the graph's inputs, its mask from the masks' buffer),
so a decode step waits once; rows that need more (a seeded request's own generator, logprobs, a
logits hook) are drawn eagerly from the graph's logits.
Prefill or mixed steps, and decode steps wider than the captured page tables, run eagerly. The CPU
never uses graphs. Must never change a sequence's tokens, pages or progress: the engine applies the
results (the one thing it sets is a seeded request's generator, on first use).
"""

from __future__ import annotations

import logging
import math
import time
from typing import NamedTuple

import torch

from beam_model.config import FULL, SLIDING
from beam_model.kv_cache import PagedKVCache, StepMetadata, build_step_metadata
from server.engine.block_manager import GROUPS
from server.engine.graph_inputs import GraphInputs
from server.engine.output import TokenLogprob
from server.engine.token_masks import TokenMasks

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
# The reference experts group tokens by expert (a host sync, not capturable) above 256 tokens.
MAX_GRAPH_BATCH = 256

log = logging.getLogger(__name__)


def logits_width(model) -> int:
    """The ids the model's logits cover: its whole vocabulary, on a tensor-parallel rank too (the head
    gathers every rank's slice; the rank's own config holds its slice's width)."""
    return model.config.vocab_size * (model.tp.world_size if getattr(model, "tp", None) else 1)


def token_logprobs(rows: torch.Tensor, ids: list[int], tops: list[int]) -> list[TokenLogprob]:
    """Each of `ids` (the token drawn from row j of `rows`, logits without any request's mask) with its
    log-probability under the model and the `tops[j]` most likely ids at its row, most likely first."""
    lp = rows[:len(ids)].float().log_softmax(-1)
    picked = lp.gather(1, torch.tensor(ids, device=lp.device)[:, None])[:, 0].tolist()
    top_v, top_i = lp.topk(max(max(tops), 1), dim=-1)
    top_v, top_i = top_v.tolist(), top_i.tolist()
    return [TokenLogprob(t, p, list(zip(i[:k], v[:k]))) for t, p, i, v, k in zip(ids, picked, top_i, top_v, tops)]


class Captured(NamedTuple):
    """One decode batch size's graphs: the forward (its logits [size, vocab] FP32; its metadata, alive as
    long as the graph) and the draw from those logits under the token masks' device buffer (its ids
    [size]; both None when drawing could not be captured). Two graphs, so that the host builds a step's
    grammar masks while the device runs its forward."""
    graph: object
    logits: torch.Tensor
    meta: StepMetadata
    draw: object | None
    ids: torch.Tensor | None


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
        vocab = logits_width(model)
        self.vocab_limit = vocab_limit if vocab_limit is not None else vocab
        self.generator = torch.Generator(device=self.device).manual_seed(seed)  # unseeded requests
        self.logits_hook = logits_hook  # test-only: see server/engine/testing.py
        self.grammars = None  # the engine's grammar compiler (engine/grammar.py), set on the first structured request
        self.masks = TokenMasks(max(max_num_seqs, 1), vocab, self.device)
        self.graphs: dict[int, Captured] = {}
        # On rank 0 of a tensor-parallel group: called with each forward's inputs before it is launched,
        # to send them to the other ranks, whose runners run the same forward (`follow`; engine/ranks.py)
        self.before_forward = None
        # [vocab] bool: the ids past the tokenizer's, masked before every draw; None when there are none
        past = torch.arange(vocab, device=self.device) >= self.vocab_limit
        self._past_vocab = past if self.vocab_limit < vocab else None
        self.last_prepare_seconds = 0.0  # host time of the last run before its forward was launched
        # GPU time of the last run from its forward's launch to its sampled tokens' copy (CUDA events;
        # None on the CPU, and for a run that samples nothing, which is not waited for)
        self.last_device_seconds = None
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) \
            if self.device.type == "cuda" else None
        self._launched = False  # a forward's launch is marked and its results not yet fetched
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
        self.last_device_seconds, self.masks.last_constrained = None, 0
        starts = [s.num_computed for s in seqs]
        ids = [t for s, c, n in zip(seqs, starts, counts) for t in s.token_ids[c:c + n]]
        pages = {g: [s.pages[g] for s in seqs] for g in GROUPS}
        rows = [i for i, (s, c, n) in enumerate(zip(seqs, starts, counts)) if c + n == s.num_tokens]
        if self.before_forward is not None:
            self.before_forward(ids, pages, starts, counts, [s.params for s in seqs])
        graph = self._graph_for(pages) if all(n == 1 for n in counts) else None
        drawn, allowed, sampled = None, None, [seqs[i] for i in rows]
        if graph is not None:  # one token a row
            captured = self._replay(graph, ids, pages, starts, [s.params for s in seqs], started)
            b, x = len(seqs), self._inputs
            # While the forward runs: the masks (rows mid-prompt have no grammar yet), then the draw
            allowed = self.masks.fill(self.grammars, seqs, always=captured.draw is not None)
            logits, params = captured.logits[:b], (x.temperature[:b], x.top_k[:b], x.top_p[:b])
            if captured.draw is not None:
                captured.draw.replay()
                drawn = captured.ids[:b] if self.logits_hook is None else None
            if rows and len(rows) < b:  # a prompt fed a token at a time samples at its last one only
                pick = self._to_device(rows, torch.int64)
                logits, params = logits[pick], tuple(t[pick] for t in params)
                drawn = None if drawn is None else drawn[pick]
                allowed = None if allowed is None else allowed[pick]
        else:
            params = self._sampling_params(sampled) if rows else None
            pick = self._to_device(rows, torch.int64) if rows and len(rows) < len(seqs) else None
            step = build_step_metadata(pages, starts, counts, page_size=self.page_size, device=self.device)
            ids = torch.tensor(ids, device=self.device)
            self.launching(started)
            logits = self.model.step(ids, self.cache, step)
            logits = logits if pick is None else logits[pick]
            allowed = self.masks.fill(self.grammars, sampled) if rows else None  # while the forward runs
        results: list[TokenLogprob | None] = [None] * len(seqs)
        if rows:
            for i, r in zip(rows, self._sample(sampled, logits, params, drawn, allowed)):
                results[i] = r
        return results

    @torch.inference_mode()
    def follow(self, ids: list[int], pages: dict, starts: list[int], counts: list[int], params: list) -> None:
        """Another rank's side of rank 0's `run`: the same forward on this rank's shard and KV cache (the
        same graph or the same eager step, so the collectives inside meet), nothing sampled."""
        graph = self._graph_for(pages) if all(n == 1 for n in counts) else None
        if graph is not None:
            self._replay(graph, ids, pages, starts, params, time.perf_counter())
            return
        step = build_step_metadata(pages, starts, counts, page_size=self.page_size, device=self.device)
        self.model.step(torch.tensor(ids, device=self.device), self.cache, step)

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """`values` on the device without waiting: a copy from pageable memory waits for everything
        queued on the stream (the forward), leaving the device idle until the host launches what follows.
        Pinned instead (the caching host allocator keeps each block until its copy is done)."""
        t = torch.tensor(values, dtype=dtype)
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    def _sampling_params(self, seqs: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each sampled row's temperature, top_k and top_p on the device (copied before the forward)."""
        return (self._to_device([s.params.temperature for s in seqs], torch.float32),
                self._to_device([s.params.top_k for s in seqs], torch.int64),
                self._to_device([s.params.top_p for s in seqs], torch.float32))

    def _in_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with the ids past the tokenizer's at -inf, out of place (a graph's output stays the
        model's); `logits` itself when there are none."""
        return logits if self._past_vocab is None else logits.masked_fill(self._past_vocab, float("-inf"))

    def _masked(self, logits: torch.Tensor) -> torch.Tensor:
        """FP32 `_in_vocab` logits, a copy the logits hook may edit (never a graph's output)."""
        masked = self._in_vocab(logits.float())
        return masked.clone() if masked is logits else masked

    def _sample(self, seqs: list, logits: torch.Tensor, params, drawn=None, allowed=None) -> list[TokenLogprob]:
        """The tokens of `seqs` from their logits rows, under their grammar masks (`allowed`: device rows,
        or None). `drawn`: ids a graph already drew for every row from the engine's generator under the
        same masks, used for every row that draws from it (not a seeded one). Logprobs are the model's,
        before any mask."""
        want = [i for i, s in enumerate(seqs) if s.params.logprobs]
        dev, n = self.device, len(seqs)
        seeded = [i for i, s in enumerate(seqs) if s.params.seed is not None and not s.params.greedy]
        if drawn is not None and not seeded and not want:  # the usual graphed step: nothing left to launch
            return self._results(seqs, drawn, logits, want)
        logits = self._masked(logits)
        if self.logits_hook is not None:
            self.logits_hook(seqs, logits)
        temperature, top_k, top_p = params
        sample = self.model.ops.sample
        ids = torch.empty(n, dtype=torch.int64, device=dev)
        shared = sorted(set(range(n)) - set(seeded))
        if drawn is not None:
            ids.copy_(drawn)
        elif len(shared) == n:  # the usual eager step: every row draws from the engine's generator, no gather
            ids = sample(logits, temperature, top_k, top_p, generator=self.generator, allowed=allowed)
        elif shared:  # greedy and unseeded rows: one batched draw from the engine's generator
            idx = self._to_device(shared, torch.int64)
            ids[idx] = sample(logits[idx], temperature[idx], top_k[idx], top_p[idx], generator=self.generator,
                              allowed=None if allowed is None else allowed[idx])
        for i in seeded:  # a row of its own with its own generator: reproducible whatever the batch
            ids[i:i + 1] = sample(logits[i:i + 1], temperature[i:i + 1], top_k[i:i + 1], top_p[i:i + 1],
                                  generator=self.generator_for(seqs[i]),
                                  allowed=None if allowed is None else allowed[i:i + 1])
        return self._results(seqs, ids, logits, want)

    def generator_for(self, seq) -> torch.Generator:
        """The generator `seq` draws from: its own, made from its seed on first use, for a seeded request
        (reproducible whatever the batch); else the engine's."""
        if seq.params.seed is None:
            return self.generator
        if seq.generator is None:
            seq.generator = torch.Generator(device=self.device).manual_seed(seq.params.seed)
        return seq.generator

    def _results(self, seqs: list, ids: torch.Tensor, logits: torch.Tensor, want: list[int]) -> list[TokenLogprob]:
        """Each row's token and, for the rows in `want`, its logprobs from `logits` (masked)."""
        chosen = self.fetched(ids)
        out = [TokenLogprob(t, 0.0) for t in chosen]
        if want:
            with_logprobs = token_logprobs(logits[want], [chosen[i] for i in want],
                                           [seqs[i].params.top_logprobs for i in want])
            for i, t in zip(want, with_logprobs):
                out[i] = t
        return out

    # ---- CUDA graphs -----------------------------------------------------------------------
    def _capture(self, sizes: list[int], max_pages: int) -> None:
        dev, big = self.device, max(sizes)
        self._inputs = GraphInputs(big, max_pages, GROUPS, dev)  # what `_replay` refills
        pool, draw = None, hasattr(torch.cuda.CUDAGraph, "register_generator_state")  # torch >= 2.5
        with torch.inference_mode():
            for b in sorted(sizes, reverse=True):  # largest first so the others share its memory pool
                meta = self._inputs.metadata(b, self.page_size)
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # warm-up outside capture (lazy inits, autotuning)
                    logits = self.model.step(self._inputs.ids[:b], self.cache, meta)
                    if draw:
                        self._draw(logits, b)
                torch.cuda.current_stream().wait_stream(stream)
                try:
                    captured = self._capture_one(b, meta, pool, draw)
                except Exception as e:  # noqa: BLE001 - a sampler that cannot be captured: draw eagerly
                    if not draw:
                        raise
                    log.warning("decode graphs draw tokens outside the graph: capturing the sample op failed "
                                "(%s: %s)", type(e).__name__, e)
                    draw = False
                    captured = self._capture_one(b, meta, pool, draw)
                pool = captured.graph.pool()
                self.graphs[b] = captured
        torch.cuda.synchronize()

    def _capture_one(self, b: int, meta: StepMetadata, pool, draw: bool) -> Captured:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self.model.step(self._inputs.ids[:b], self.cache, meta)
        if not draw:
            return Captured(graph, logits, meta, None, None)
        drawing = torch.cuda.CUDAGraph()
        drawing.register_generator_state(self.generator)  # each replay advances it past the draws it made
        with torch.cuda.graph(drawing, pool=graph.pool()):
            ids = self._draw(logits, b)
        return Captured(graph, logits, meta, drawing, ids)

    def _draw(self, logits: torch.Tensor, b: int) -> torch.Tensor:
        """Each of the `b` rows' token from the engine's generator at the row's settings in the graph's
        inputs and under the token masks' device buffer (as `_sample` draws an unseeded row)."""
        x = self._inputs
        return self.model.ops.sample(self._in_vocab(logits), x.temperature[:b], x.top_k[:b], x.top_p[:b],
                                     generator=self.generator,
                                     allowed=self.masks.device_buffer[:b])

    def _graph_for(self, pages: dict[str, list[list[int]]]):
        b = len(pages[FULL])
        if not self.graphs or b > max(self.graphs) or max(map(len, pages[FULL])) > self._inputs.max_pages:
            return None
        return min(size for size in self.graphs if size >= b)

    def _replay(self, size: int, ids: list[int], pages, starts: list[int], params: list, started: float) -> Captured:
        """Refill the graph's inputs (`params`: each row's SamplingParams) and replay it."""
        sampling = [(p.temperature, p.top_k, p.top_p) for p in params]
        lens = self._inputs.fill(size, ids, starts, pages, self.page_size, sampling)
        captured = self.graphs[size]
        for g in GROUPS:  # host copies of the layout, for variants that plan on the host
            captured.meta.groups[g].seq_lens_host[:] = lens
        self.model.replan(captured.meta)
        self.launching(started)
        captured.graph.replay()
        return captured

    def launching(self, started: float) -> None:
        """A step's forward is launched next (`started`: when the step began on the host): its host time so
        far, and the device-time event of the launch. Every step's forward (this runner's, a drafter's)
        calls it, so `fetched` measures that step."""
        self.last_prepare_seconds = time.perf_counter() - started
        self.last_device_seconds = None
        self._launched = True
        self._mark(0)

    def fetched(self, values: torch.Tensor) -> list:
        """`values` on the host (waiting for the step), and the device time since `launching`."""
        self._mark(1)
        out = values.tolist()
        if self._events is not None and self._launched:
            self.last_device_seconds = self._events[0].elapsed_time(self._events[1]) / 1e3
        self._launched = False
        return out

    def _mark(self, i: int) -> None:
        """Record device-time event `i` (0: forward launched, 1: tokens drawn) on the current stream."""
        if self._events is not None:
            self._events[i].record()
