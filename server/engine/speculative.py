"""Speculative decoding with a DFlash drafter: each decode step verifies a block in one target step.

A decoding sequence feeds its last token and the drafts proposed after it (`DraftState.ids`) in one
target step; the target's logits at those rows decide how many drafts are kept (`accept`): greedy, the
drafts that equal the target's argmax; sampled, each draft with probability min(1, p/q) and, at the
first rejection, a token drawn from max(p - q, 0) renormalised (so the output follows the target's own
distribution exactly, p and q being the `sample` contract's distributions of the target's and the
drafter's logits under the request's temperature, top-k and top-p). After the kept drafts, the target's
own token (the bonus) comes from the first row not kept. The KV of rejected drafts is rolled back by
the engine (progress advances only over kept tokens; `BlockManager.trim` releases pages past it).

The same step gives the target's tapped hidden states of every token it fed, from which the drafter
writes its layers' keys and values of those positions to its store of the target's sliding-window pages
(the same page ids; a rejected draft's are overwritten when its position is fed again, as the target's
are); once the engine has appended the step's tokens the drafter proposes the next block after the last
one from the window of keys before it (`propose`; always a block of the size it was trained at, of which
the first K drafts are kept: run on a shorter block, its first drafts are far worse), a grammar's drafts each under its
matcher's mask after the drafts before it (`DraftState.masks`, which the verify step's rows are masked
with). Rows that sample without drafts (a prompt's first token) draw through the runner's sampler,
masks included; a logprobs request's kept tokens take their logprobs from the verify step's rows.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from beam_model.config import SLIDING
from beam_model.drafter import ContextKV
from beam_model.kv_cache import build_step_metadata
from server.engine.block_manager import GROUPS
from server.engine.grammar import mask_words
from server.engine.model_runner import token_logprobs
from server.engine.output import TokenLogprob
from workbench.variants.sample import contract_probs, mask_logits


@dataclass
class DraftState:
    """A sequence's drafter side: the drafts proposed after its last token and, for a sampled request,
    the drafter's distribution of each."""
    ids: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None          # [len(ids), vocab] FP64, sampled requests only
    confidence: list[float] = field(default_factory=list)  # the drafter's probability of each draft
    # a request with a grammar: its masks (host [len(ids) + 1, words] int32) after its last token and
    # after each draft, the `sample` contract's `allowed` of the verify step's rows
    masks: torch.Tensor | None = None

    def clear_drafts(self) -> None:
        self.ids, self.probs, self.confidence, self.masks = [], None, [], None


@dataclass
class SpecStats:
    """Counters for /metrics: verify steps, drafted and accepted tokens, and how many drafts each verify
    step kept (a histogram over 0 .. K)."""
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    histogram: list[int] = field(default_factory=list)

    def record(self, drafted: int, kept: int) -> None:
        self.verify_steps += 1
        self.drafted += drafted
        self.accepted += kept
        if len(self.histogram) <= kept:
            self.histogram += [0] * (kept + 1 - len(self.histogram))
        self.histogram[kept] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step: the kept drafts and the bonus token."""
        return 1.0 + self.accepted / self.verify_steps if self.verify_steps else 0.0


class VerifyCost:
    """A step's seconds as a + b * tokens fed. a comes from the last steps seen (their wall time, the host's
    share included); b, what one more fed token costs, is the device's where it was measured
    (`per_token_s`: the fused graphs' replays, `verify_draft.VerifyDraft`), else fitted by least squares to
    the same steps. A fit of wall times is fragile where a token costs the device a few microseconds and a
    step's host work varies by more: a slope fitted to that noise makes every draft look costly, so
    fewer are verified, so the steps vary less and the fit cannot recover. Until the steps vary enough to
    fit, b is a / PRIOR_TOKENS (a step costs twice as much at that many tokens: batch-1 decode is bound by
    weight reads, so a few more tokens cost little)."""

    PRIOR_TOKENS = 64.0
    WINDOW = 256

    def __init__(self):
        self.samples: deque = deque(maxlen=self.WINDOW)
        self.per_token_s: float | None = None

    def record(self, tokens: int, seconds: float) -> None:
        self.samples.append((float(tokens), seconds))

    def coefficients(self) -> tuple[float, float]:
        b = self.per_token_s
        if not self.samples:
            return (1.0, 1.0 / self.PRIOR_TOKENS) if b is None else (max(b * self.PRIOR_TOKENS, 1e-9), b)
        xs, ys = zip(*self.samples)
        n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
        if b is not None:
            return max(my - b * mx, 1e-9), b
        var = sum((x - mx) ** 2 for x in xs)
        if n < 8 or var == 0:
            a = my / (1 + mx / self.PRIOR_TOKENS)
            return a, a / self.PRIOR_TOKENS
        b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var)
        return max(my - b * mx, 1e-9), b


def verified_drafts(confidences: list[list[float]], sampling: int, tokens: int, cost: tuple[float, float]) -> list[int]:
    """How many of each sequence's drafts to verify so that the step's expected tokens per second is
    highest: draft j of a sequence is kept with probability about the product of the drafter's own
    probabilities of drafts 1..j (`confidences`), and each verified token adds b to the step's a + b *
    tokens seconds (`tokens`: what the step feeds without drafts; `sampling`: the sequences that emit a
    token). Drafts are added best first while one more raises tokens per second."""
    a, b = cost
    gains = []
    for i, conf in enumerate(confidences):
        p = 1.0
        for j, c in enumerate(conf):
            p *= c
            gains.append((p, -j, i))
    gains.sort(reverse=True)
    chosen = [0] * len(confidences)
    expected, fed = float(sampling), float(tokens)
    for p, neg_j, i in gains:
        if -neg_j != chosen[i] or p * (a + b * fed) <= expected * b:  # only the next draft of a prefix
            continue
        chosen[i], expected, fed = chosen[i] + 1, expected + p, fed + 1
    return chosen


def accept(target_logits: torch.Tensor, drafts: list[int], params, draft_probs: torch.Tensor | None,
           generator: torch.Generator | None) -> tuple[int, int]:
    """(drafts kept, the bonus token) from the target's logits rows [len(drafts) + 1, vocab] (FP32,
    out-of-vocabulary ids at -inf) at the last token and each draft."""
    k = len(drafts)
    if params.greedy:
        best = target_logits.argmax(-1).tolist()
        kept = next((j for j in range(k) if best[j] != drafts[j]), k)
        return kept, best[kept]
    p = request_probs(target_logits, params)
    u = torch.rand(k + 1, generator=generator, device=generator.device if generator else None,
                   dtype=torch.float64).tolist()
    for j in range(k):
        d = drafts[j]
        q_d = float(draft_probs[j, d])
        p_d = float(p[j, d])
        if q_d > 0 and u[j] * q_d <= p_d:   # kept with probability min(1, p/q)
            continue
        residual = (p[j] - draft_probs[j].to(p.device)).clamp(min=0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p[j]
        return j, _draw(dist, generator)
    return k, _draw(p[k], generator)


def request_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """FP64 probabilities [rows, vocab] of the `sample` contract's distribution of each row of `logits`
    under the request's temperature, top-k and top-p."""
    rows, dev = logits.shape[0], logits.device
    return contract_probs(logits, torch.full((rows,), params.temperature, device=dev),
                          torch.full((rows,), params.top_k, device=dev, dtype=torch.int64),
                          torch.full((rows,), params.top_p, device=dev))


def _draw(dist: torch.Tensor, generator) -> int:
    return int(torch.multinomial(dist.float(), 1, generator=generator))


class Speculator:
    """Runs the engine's steps when a drafter is loaded (`run` in place of `ModelRunner.run`), and
    proposes each sequence's next drafts after them."""

    def __init__(self, runner, drafter, num_speculative_tokens: int, *, max_num_seqs: int, adaptive: bool = False):
        if not 1 <= num_speculative_tokens < drafter.config.block_size:
            raise ValueError(f"num_speculative_tokens must be in 1..{drafter.config.block_size - 1} (the "
                             f"drafter's block holds the last token and {drafter.config.block_size - 1} drafts)")
        if drafter.config.block_size > runner.page_size:
            raise ValueError(f"the drafter's block of {drafter.config.block_size} tokens does not fit a KV page "
                             f"({runner.page_size})")
        if not any(t == SLIDING for t in runner.model.config.layer_types):
            raise ValueError("the drafter keeps its context's keys in the target's sliding-window pages; this "
                             "target has no sliding-window layers")
        self.runner, self.drafter, self.k = runner, drafter, num_speculative_tokens
        # the drafter's keys and values of every computed position, on the target's sliding page ids, and
        # past them a page for each block a step drafts
        self.sliding_pages = runner.cache.num_pages[SLIDING]
        self.store = drafter.context_store(self.sliding_pages + max_num_seqs, runner.page_size)
        self.taps = tuple(drafter.config.target_layer_ids)
        self.stats = SpecStats()
        self.adaptive, self.cost = adaptive, VerifyCost()
        self.fused = None  # a `verify_draft.VerifyDraft` for the steps it fits (the engine's, with CUDA graphs)

    def wants_drafts(self, seq) -> bool:
        """Whether the drafter proposes for `seq`: for every request (a grammar's drafts follow it)."""
        return not seq.finished

    @torch.inference_mode()
    def run(self, seqs: list, counts: list[int]) -> list[tuple[int, list[TokenLogprob]]]:
        """Feed each sequence's pending tokens and its drafts (`counts[i]` = pending fed + drafts); returns
        per sequence the positions now computed and its new tokens (none for a sequence mid-prompt)."""
        runner, model = self.runner, self.runner.model
        started = time.perf_counter()
        starts = [s.num_computed for s in seqs]
        drafts = [c - min(c, s.num_pending) for s, c in zip(seqs, counts)]
        for s in seqs:
            s.draft = s.draft or DraftState()
        if self.adaptive and any(drafts):
            sampling = sum(1 for s, c, k in zip(seqs, counts, drafts) if k or s.num_computed + c == s.num_tokens)
            chosen = verified_drafts([s.draft.confidence[:k] for s, k in zip(seqs, drafts)], sampling,
                                     sum(counts) - sum(drafts), self.cost.coefficients())
            counts = [c - k + n for c, k, n in zip(counts, drafts, chosen)]
            drafts = chosen
        if self.fused is not None and self.fused.fits(seqs, counts):
            out = self.fused.run(seqs, counts)
            self.cost.record(sum(counts), time.perf_counter() - started)
            return out
        ids = [t for s, c, n, k in zip(seqs, starts, counts, drafts)
               for t in s.token_ids[c:c + n - k] + s.draft.ids[:k]]
        pages = {g: [s.pages[g] for s in seqs] for g in GROUPS}
        step = build_step_metadata(pages, starts, counts, page_size=runner.page_size, device=runner.device)
        ids = torch.tensor(ids, device=runner.device)
        runner.launching(started)
        logits, tapped = model.step(ids, runner.cache, step, all_logits=True, taps=self.taps)
        logits = runner._in_vocab(logits)
        ends = list(itertools.accumulate(counts))  # each sequence's rows end here
        out: list[tuple[int, list[TokenLogprob]]] = []
        plain = [i for i, (s, n, k) in enumerate(zip(seqs, counts, drafts))
                 if k == 0 and starts[i] + n == s.num_tokens]
        drawn = self._plain(seqs, plain, logits, ends)
        for i, (s, n, k) in enumerate(zip(seqs, counts, drafts)):
            if k:
                rows = logits[ends[i] - k - 1:ends[i]]
                allowed = None if s.draft.masks is None else s.draft.masks[:k + 1].to(runner.device)
                kept, bonus = accept(mask_logits(rows, allowed), s.draft.ids[:k], s.params, s.draft.probs,
                                     runner.generator_for(s))
                self.stats.record(k, kept)
                emitted = s.draft.ids[:kept] + [bonus]
                tokens = token_logprobs(rows, emitted, [s.params.top_logprobs] * len(emitted)) \
                    if s.params.logprobs else [TokenLogprob(t, 0.0) for t in emitted]
                out.append((n - k + kept, tokens))
            else:
                out.append((n, [drawn[i]] if i in drawn else []))
        self.write_context(tapped, step.positions, step.groups[SLIDING].slot_mapping)
        for s in seqs:
            s.draft.clear_drafts()
        self.cost.record(sum(counts), time.perf_counter() - started)  # the tokens' values waited for: a full step
        return out

    def write_context(self, tapped: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """The drafter's keys and values of a step's fed rows (their tapped hidden states [N, width], positions
        and sliding-window cache slots [N]), kept or not: a later block reads only kept positions."""
        self.drafter.write_context(self.drafter.context_features(tapped), positions, slots, self.store)

    def context(self, tables: torch.Tensor, starts: torch.Tensor) -> ContextKV:
        """Where blocks at `starts` [S] find their context: each sequence's sliding page table [S, pages]."""
        blocks = self.sliding_pages + torch.arange(len(starts), device=starts.device)
        return ContextKV.from_page_table(self.store, tables, starts, self.drafter.config.sliding_window, blocks)

    @torch.inference_mode()
    def propose(self, seqs: list) -> None:
        """The next drafts of each of `seqs` after the tokens a step gave it (called once the engine has
        appended them, so a grammar's matcher stands after them); a sequence that has drafts already
        (the graphed step drafts on the device) or has finished gets none."""
        self._propose([(s, s.token_ids[-1], s.num_tokens - 1) for s in seqs
                       if s.draft is not None and not s.draft.ids and self.wants_drafts(s)])

    def _plain(self, seqs, rows: list[int], logits, ends) -> dict[int, TokenLogprob]:
        """The runner's own draw (masks, seeds, logprobs) for the rows that sample without drafts."""
        if not rows:
            return {}
        runner, picked = self.runner, [seqs[i] for i in rows]
        last = torch.tensor([ends[i] - 1 for i in rows], device=runner.device)
        allowed = runner.masks.fill(runner.grammars, picked)
        samples = runner._sample(picked, logits[last], runner._sampling_params(picked), allowed=allowed)
        return dict(zip(rows, samples))

    def _propose(self, items: list[tuple]) -> None:
        """The next drafts of each (sequence, its last token, that token's position)."""
        if not items:
            return
        dev, k = self.runner.device, self.k
        pages = [s.pages[SLIDING] for s, _, _ in items]
        width = max(1, *map(len, pages))
        tables = torch.tensor([p + [-1] * (width - len(p)) for p in pages], dtype=torch.int64, device=dev)
        first = torch.tensor([t for _, t, _ in items], device=dev)
        starts = torch.tensor([p for _, _, p in items], device=dev)
        context = self.context(tables, starts)
        logits = self.runner._in_vocab(self.drafter.block_logits(first, starts, context)[:, :k])
        for j, (s, _, _) in enumerate(items):
            if s.matcher is not None:
                self._propose_in_grammar(s, logits[j])
                continue
            probs, ids = self._drafts_from(s, logits[j])
            s.draft.ids, s.draft.probs = ids.tolist(), None if s.params.greedy else probs
            s.draft.confidence = probs.gather(1, ids[:, None])[:, 0].tolist()

    def _drafts_from(self, s, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the distributions [n, vocab], the drafts [n]) of `s` from the drafter's logits rows: greedy,
        the argmax (its softmax for confidence); sampled, a draw from the `sample` contract's distribution."""
        if s.params.greedy:
            return logits.softmax(-1), logits.argmax(-1)
        probs = request_probs(logits, s.params)
        return probs, torch.multinomial(probs.float(), 1, generator=self.runner.generator_for(s))[:, 0]

    def _propose_in_grammar(self, s, logits: torch.Tensor) -> None:
        """Drafts that follow `s`'s grammar: each drawn under the mask of the matcher advanced over the
        drafts before it (the masks kept for the verify step's rows), then the matcher (and its
        reasoning budget) set back to where the sequence stands. Drafting stops where the grammar takes
        no token (it has ended)."""
        grammars, matcher, dev = self.runner.grammars, s.matcher, self.runner.device
        masks = torch.empty(self.k + 1, mask_words(logits.shape[-1]), dtype=torch.int32)
        budget = copy.copy(matcher.budget)
        ids, probs, confidence = [], [], []
        try:
            for j in range(self.k + 1):
                masks[j].fill_(-1)
                grammars.fill([(j, matcher)], masks)
                if j == self.k or matcher.llg.is_stopped():
                    break
                row = mask_logits(logits[j:j + 1], masks[j:j + 1].to(dev))
                if not torch.isfinite(row).any():  # nothing the grammar takes is in the drafter's vocabulary
                    break
                p, t = self._drafts_from(s, row)
                token = int(t[0])
                if not matcher.accept(token):
                    break
                ids.append(token)
                probs.append(p)
                confidence.append(float(p[0, token]))
        finally:  # the sequence's own tokens only, whatever happened
            matcher.llg.rollback(len(ids))
            matcher.budget = budget
        s.draft.ids, s.draft.confidence, s.draft.masks = ids, confidence, masks[:len(ids) + 1]
        s.draft.probs = torch.cat(probs) if probs and not s.params.greedy else None


def limit_drafts(seq, budget: int, max_model_len: int) -> int:
    """How many of `seq`'s drafts a step can feed: within the step's token budget (one token is its last
    one), the context length and its remaining `max_tokens` (the bonus token always comes too)."""
    room = min(budget - 1, max_model_len - seq.num_tokens - 1, seq.params.max_tokens - seq.num_output_tokens - 1)
    return max(0, min(len(seq.draft.ids) if seq.draft else 0, room))

