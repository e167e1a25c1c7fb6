"""Verify and draft in one step, one CUDA graph replay on the GPU.

A verify step of b sequences with K drafts each feeds b * (K + 1) tokens. Fed as b * (K + 1) decode
rows, one a token, each with its sequence's page table at its own position, it has the shape of a
decode step: every row's KV is written before the attention reads it and each row sees the keys up to
its own position, the block's causal attention. So it is captured as a decode step is (one graph per
batch size, block width and whether any row samples; padded rows write the reserved page 0). The graph
runs, on the device:

- the target's step over the rows: logits at every row, and the drafter's tapped layers;
- the acceptance: greedy, the drafts kept are the leading ones equal to the target's argmax and the
  bonus token the target's argmax after them; sampled, rejection sampling against the drafter's
  distributions (as `speculative.accept`), drawn from the engine's generator, which the graph advances
  (on a GPU in three Triton launches a step: `block_sampling`);
- the drafter's keys and values of every fed row, written to its store on the rows' sliding-window
  slots (`Speculator.write_context`);
- the drafter's next block after the bonus token, reading the window before it through the sequence's
  sliding page table, its drafts (greedy, or drawn) and their distributions.

A step whose rows are all greedy replays a graph without the sampling half (no distributions, no
draws: argmaxes).

The host then reads the kept counts, bonus tokens and drafts in one copy. The step stands in for
`Speculator.run` where it applies (`fits`): every sequence decoding with its drafts, greedy or
unseeded (a seeded request draws from its own generator, eagerly), no grammar, logprobs or logits
hook. A step's blocks are as wide as the narrowest captured width (1, 2, 4, 8 or K + 1 rows) that
holds its longest; a sequence with fewer drafts (adaptive verification chose fewer, or it nears its
end) fills its block with padding rows and keeps none of them. Elsewhere the eager step runs. The
graphs run the kernels that read the KV cache with programmatic dependent launch off (`without_cache_pdl`:
a block's rows are decode rows of one sequence, whose keys the step writes). On the CPU the same body
runs eagerly (`graphs=False`), which is how the tests hold it to the eager step. Once
captured, the greedy graphs are timed: what one more row costs the device is adaptive verification's
cost of a verified draft (`speculative.VerifyCost`).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time

import torch

from beam_model.config import SLIDING
from server.engine.block_manager import GROUPS
from server.engine.block_sampling import accept_drafts, draft_draws, target_probs
from server.engine.graph_inputs import GraphInputs
from server.engine.model_runner import logits_width
from server.engine.output import TokenLogprob
from workbench.registry import bind
from workbench.registry import without_cache_pdl as configs_without_cache_pdl

BATCH_SIZES = (1, 2, 4, 8, 16)
BLOCK_WIDTHS = (1, 2, 4, 8)  # rows a sequence feeds (its last token and drafts), captured besides K + 1
PADDING_PAGES = [0]  # a padding row writes and reads the reserved page 0 only
TIMED_REPLAYS = 5  # of each greedy graph, for what a fed row costs (`row_seconds`)


class VerifyDraft:
    def __init__(self, speculator, *, max_num_seqs: int, graph_max_len: int, graphs: bool):
        runner, drafter = speculator.runner, speculator.drafter
        self.spec, self.runner, self.drafter, self.k = speculator, runner, drafter, speculator.k
        dev = runner.device
        # b * (K + 1) rows at most what a decode graph holds
        top = max(1, min(max_num_seqs, 256 // (self.k + 1)))
        self.sizes = sorted({b for b in BATCH_SIZES if b < top} | {top})
        # adaptive verification feeds fewer drafts: the narrowest captured block that holds a step's
        self.widths = sorted({w for w in BLOCK_WIDTHS if w < self.k + 1} | {self.k + 1})
        rows = max(self.sizes) * (self.k + 1)
        self.inputs = GraphInputs(rows, math.ceil(graph_max_len / runner.page_size), GROUPS, dev)
        b = max(self.sizes)
        # a sampled sequence's drafter distributions of its drafts (the `sample` contract's, FP64)
        self.draft_probs = torch.zeros(b, self.k, logits_width(runner.model), dtype=torch.float64, device=dev)
        # (batch size, width, whether any row samples) -> (graph, its metadata, its outputs)
        self.graphs: dict[tuple[int, int, bool], tuple] = {}
        self.steps = 0  # steps run here
        self._ops = None  # (target, drafter) ops the graphs run (`_captured_ops`)
        if graphs and dev.type == "cuda":
            self._capture()

    def fits(self, seqs: list, counts: list[int]) -> bool:
        """Whether this step can run here: each sequence one pending token and up to K drafts, free text,
        greedy or drawing from the engine's generator."""
        if self.runner.logits_hook is not None or len(seqs) > max(self.sizes):
            return False
        width = self.inputs.max_pages
        return all(1 <= n <= self.k + 1 and s.num_pending == 1 and s.matcher is None and not s.params.logprobs
                   and (s.params.greedy or s.params.seed is None)  # the engine's generator, not a request's
                   and s.draft is not None and len(s.draft.ids) >= n - 1
                   and (s.params.greedy or n == 1 or s.draft.probs is not None)
                   and max(len(s.pages[g]) for g in GROUPS) <= width for s, n in zip(seqs, counts))

    @torch.inference_mode()
    def run(self, seqs: list, counts: list[int]) -> list[tuple[int, list[TokenLogprob]]]:
        """`Speculator.run` for a step that `fits`: per sequence the positions computed and its new tokens."""
        started = time.perf_counter()
        b, page = len(seqs), self.runner.page_size
        self.steps += 1
        size = min(s for s in self.sizes if s >= b) if self.graphs else b
        w = min(w for w in self.widths if w >= max(counts))
        sampled = not all(s.params.greedy for s in seqs)
        starts = [s.num_computed for s in seqs]
        ids, row_starts, row_pages = block_rows(seqs, starts, counts, w)
        sampling = [(s.params.temperature, s.params.top_k, s.params.top_p) for s in seqs for _ in range(w)]
        lens = self.inputs.fill(size * w, ids, row_starts, row_pages, page, sampling)
        self._fill_draft_probs(seqs, counts)
        if self.graphs:
            graph, meta, out = self.graphs[size, w, sampled]
            for g in GROUPS:  # host copies of the layout, for variants that plan on the host
                meta.groups[g].seq_lens_host[:] = lens
            with self._captured_ops():
                self.runner.model.replan(meta)
            self.runner.launching(started)
            graph.replay()
        else:
            self.runner.launching(started)
            out = self._body(b, w, self.inputs.metadata(b * w, page, lens), sampled)
        kept, bonus, drafts, probs, confidence = out
        picked = self.runner.fetched(torch.cat([kept[:b, None], bonus[:b, None], drafts[:b]], 1))
        confidence = confidence[:b].tolist() if self.spec.adaptive else [[]] * b  # ready: the step is done
        results = []
        for i, (s, n, (n_kept, n_bonus, *next_drafts)) in enumerate(zip(seqs, counts, picked)):
            tokens = [TokenLogprob(t, 0.0) for t in s.draft.ids[:n_kept]] + [TokenLogprob(n_bonus, 0.0)]
            if n > 1:
                self.spec.stats.record(n - 1, n_kept)
            s.draft.ids, s.draft.confidence = next_drafts, confidence[i]
            s.draft.probs = probs[i].clone() if sampled and not s.params.greedy else None
            results.append((1 + n_kept, tokens))
        return results

    def _fill_draft_probs(self, seqs: list, counts: list[int]) -> None:
        """A sampled sequence's drafter distributions of the drafts it feeds, where the graph reads them."""
        for i, (s, n) in enumerate(zip(seqs, counts)):
            if not s.params.greedy and n > 1:
                self.draft_probs[i, :n - 1] = s.draft.probs[:n - 1]

    def _body(self, b: int, w: int, meta, sampled: bool):
        """The step on the device for b sequences of w rows each: (kept [b], bonus [b], next drafts [b, K],
        the drafts' distributions [b, K, vocab] FP64 (a sampled sequence's; None
        where no row samples), the drafts' confidences [b, K]). With `sampled` false every row is greedy and
        the step has no distributions to build or draws to make: argmaxes only."""
        k, x, runner, drafter = self.k, self.inputs, self.runner, self.drafter
        rows = b * w
        logits, tapped = runner.model.step(x.ids[:rows], runner.cache, meta, all_logits=True, taps=self.spec.taps)
        logits = runner._in_vocab(logits)
        block = x.ids[:rows].view(b, w)
        settings = (x.temperature[:rows], x.top_k[:rows], x.top_p[:rows])
        greedy = settings[0].view(b, w)[:, 0] == 0
        limit = keepable(x.pos[:rows], b, w)
        if sampled:
            kept, bonus = self._accept(logits.view(b, w, -1), block[:, 1:], settings, greedy, limit)
        else:
            kept, bonus = self._accept_greedy(logits.view(b, w, -1), block[:, 1:], limit)
        sliding = meta.groups[SLIDING]
        first = x.pos[:rows].view(b, w)[:, 0] + kept + 1
        context = self.spec.context(sliding.page_table.view(b, w, -1)[:, 0], first)  # a block's first row's table
        # the fed rows' keys (`Speculator.write_context`) in the block's own projections
        fed = (drafter.context_features(tapped), x.pos[:rows], sliding.slot_mapping)
        # the drafter's whole block, as it was trained; the first K drafts go on
        draft_logits = runner._in_vocab(drafter.block_logits(bonus, first, context, fed=fed)[:, :k])
        if not sampled:
            drafts = draft_logits.argmax(-1)
            confidence = draft_logits.softmax(-1).gather(2, drafts[..., None])[..., 0]
            return kept, bonus, drafts, None, confidence
        # each sequence's K draft rows at its settings (those of its verify rows)
        rows_k = (t.view(b, w)[:, :1].expand(b, k).reshape(-1) for t in settings)
        probs, drafts, confidence = draft_draws(draft_logits.reshape(b * k, -1), *rows_k, self._noise(b * k))
        return kept, bonus, drafts.view(b, k), probs.view(b, k, -1), confidence.view(b, k)

    @staticmethod
    def _accept_greedy(logits, drafts, limit):
        """(kept [b], bonus [b]) of greedy blocks: the leading drafts equal to the target's argmax, at most
        `limit` [b] (padding rows are never kept), and the argmax after them."""
        b, k1, _ = logits.shape
        best = logits.argmax(-1)
        kept = torch.minimum((best[:, :k1 - 1] == drafts).long().cumprod(1).sum(1), limit)
        return kept, best.gather(1, kept[:, None])[:, 0]

    def _accept(self, logits, drafts, settings, greedy, limit):
        """(kept [b], bonus [b]) from the target's logits [b, w, vocab] of each block: greedy, as
        `_accept_greedy`; sampled, rejection sampling against the drafts' distributions (`Speculator`'s
        `accept`, its draws from the engine's generator)."""
        b, k1, vocab = logits.shape
        kept_g, bonus_g = self._accept_greedy(logits, drafts, limit)
        p = target_probs(logits.view(b * k1, vocab), *settings).view(b, k1, vocab)
        u = torch.rand(b, k1 - 1, dtype=torch.float64, device=logits.device, generator=self.runner.generator)
        return accept_drafts(p, self.draft_probs[:b, :k1 - 1], drafts, u, limit, self._noise(b), greedy, kept_g,
                             bonus_g)

    def _noise(self, rows: int) -> torch.Tensor:
        """Exp(1) draws [rows, vocab] FP64 from the engine's generator, for the exponential races
        (`block_sampling`)."""
        width = self.draft_probs.shape[-1]
        return torch.empty(rows, width, dtype=torch.float64, device=self.draft_probs.device).exponential_(
            generator=self.runner.generator)

    @contextlib.contextmanager
    def _captured_ops(self):
        """The target and the drafter bound, for the block, to the kernels the graphs run: the same
        variants and configs, PDL off where a kernel reads the KV cache (captured with them, and re-planned with
        them before a replay)."""
        model, drafter = self.runner.model, self.drafter
        bound = model.ops, drafter.ops
        if self._ops is None:
            self._ops = without_cache_pdl(model.ops), without_cache_pdl(drafter.ops)
        model.ops, drafter.ops = self._ops
        try:
            yield
        finally:
            model.ops, drafter.ops = bound

    def _capture(self) -> None:
        with self._captured_ops():
            self._capture_sizes()
        self.spec.cost.per_token_s = self.row_seconds()

    def row_seconds(self) -> float | None:
        """What one more fed row costs the device: the greedy graphs' median replay times fitted against
        their rows (batch size * width) by least squares; None where the graphs hold one row count only.
        Replayed on the inputs they were captured with: padding rows, which write the reserved page 0 only."""
        rows, seconds = [], []
        for (b, w, sampled), (graph, _, _) in self.graphs.items():
            if sampled:  # a replay advances the engine's generator
                continue
            graph.replay()
            times = []
            for _ in range(TIMED_REPLAYS):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            rows.append(b * w)
            seconds.append(statistics.median(times))
        if len(set(rows)) < 2:
            return None
        return max(0.0, statistics.linear_regression(rows, seconds).slope)

    def _capture_sizes(self) -> None:
        pool, page = None, self.runner.page_size
        # largest first so the others share its memory pool
        shapes = sorted(((b, w, sampled) for b in self.sizes for w in self.widths for sampled in (True, False)),
                        key=lambda shape: -shape[0] * shape[1])
        with torch.inference_mode():
            for b, w, sampled in shapes:
                meta = self.inputs.metadata(b * w, page)
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # warm-up outside capture (lazy inits, autotuning)
                    self._body(b, w, meta, sampled)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                if sampled:
                    graph.register_generator_state(self.runner.generator)  # each replay draws afresh
                with torch.cuda.graph(graph, pool=pool):
                    out = self._body(b, w, meta, sampled)
                pool = graph.pool()
                self.graphs[b, w, sampled] = (graph, meta, out)
        torch.cuda.synchronize()


def block_rows(seqs: list, starts: list[int], counts: list[int], w: int) -> tuple[list, list, dict]:
    """The decode rows of a verify step: per sequence its last token and `counts[i] - 1` drafts at their
    positions with its page tables, then padding rows up to `w` (token 0 at position 0 on the reserved
    page). Returns (ids, positions, page tables per group)."""
    ids, positions, pages = [], [], {g: [] for g in GROUPS}
    for s, start, n in zip(seqs, starts, counts):
        ids += [s.token_ids[start]] + s.draft.ids[:n - 1] + [0] * (w - n)
        positions += [*range(start, start + n)] + [0] * (w - n)
        for g in GROUPS:
            pages[g] += [s.pages[g]] * n + [PADDING_PAGES] * (w - n)
    return ids, positions, pages


def keepable(positions: torch.Tensor, b: int, w: int) -> torch.Tensor:
    """The drafts each of b blocks of w rows can keep [b]: its draft rows, which follow the block's first
    token and so never sit at position 0, where every padding row does (`block_rows`)."""
    return (positions.view(b, w)[:, 1:] > 0).sum(1)


def without_cache_pdl(ops):
    """`ops` rebound with programmatic dependent launch off where a kernel reads the KV cache
    (`registry.without_cache_pdl`)."""
    return bind(ops.selection, configs_without_cache_pdl(ops.configs))
