"""Speculative decoding with a DFlash drafter: each decode step verifies a block in one target step.

A decoding sequence feeds its last token and the drafts proposed after it (`DraftState.ids`) in one
target step; the target's logits at those rows decide how many drafts are kept (`accept`): greedy, the
drafts that equal the target's argmax; sampled, each draft with probability min(1, p/q) and, at the
first rejection, a token drawn from max(p - q, 0) renormalised (so the output follows the target's own
distribution exactly, p and q being the `sample` contract's distributions of the target's and the
drafter's logits under the request's temperature, top-k and top-p). After the kept drafts, the target's
own token (the bonus) comes from the first row not kept. The KV of rejected drafts is rolled back by
the engine (progress advances only over kept tokens; `BlockManager.trim` releases pages past it).

The same step gives the target's tapped hidden states of every token it kept, which become the
drafter's context features (`DraftState.context`); the drafter then proposes the next block after the
bonus token. Rows that sample without drafts (a prompt's first token, a request with a grammar or
logprobs, which the drafter skips) draw through the runner's sampler, masks included.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from beam_model.kv_cache import build_step_metadata
from server.engine.block_manager import GROUPS
from server.engine.output import TokenLogprob
from workbench.variants.sample import contract_probs


@dataclass
class DraftState:
    """A sequence's drafter side: context features of positions [end - len(context), end), the drafts
    proposed after its last token and, for a sampled request, the drafter's distribution of each."""
    context: torch.Tensor | None = None
    end: int = 0
    ids: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None          # [len(ids), vocab] FP64, sampled requests only
    confidence: list[float] = field(default_factory=list)  # the drafter's probability of each draft

    def extend(self, start: int, features: torch.Tensor, window: int) -> None:
        """Context features of positions start .. start + n - 1 (recomputed positions replace theirs; a gap
        before `start`, positions served from the prefix cache, starts the context afresh)."""
        if self.context is None or start > self.end or start <= self.end - len(self.context):
            self.context = features[-window:]
        else:
            kept = self.context[:len(self.context) - (self.end - start)]
            self.context = torch.cat([kept, features])[-window:]
        self.end = start + len(features)

    def clear_drafts(self) -> None:
        self.ids, self.probs, self.confidence = [], None, []


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
    """A step's seconds as a + b * tokens fed, fitted by least squares to the last steps seen. Until the
    steps vary enough to fit, b is a / PRIOR_TOKENS (a step costs twice as much at that many tokens:
    batch-1 decode is bound by weight reads, so a few more tokens cost little)."""

    PRIOR_TOKENS = 64.0
    WINDOW = 256

    def __init__(self):
        self.samples: deque = deque(maxlen=self.WINDOW)

    def record(self, tokens: int, seconds: float) -> None:
        self.samples.append((float(tokens), seconds))

    def coefficients(self) -> tuple[float, float]:
        if not self.samples:
            return 1.0, 1.0 / self.PRIOR_TOKENS
        xs, ys = zip(*self.samples)
        n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
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

    def __init__(self, runner, drafter, num_speculative_tokens: int, *, adaptive: bool = False):
        if not 1 <= num_speculative_tokens < drafter.config.block_size:
            raise ValueError(f"num_speculative_tokens must be in 1..{drafter.config.block_size - 1} (the "
                             f"drafter's block holds the last token and {drafter.config.block_size - 1} drafts)")
        self.runner, self.drafter, self.k = runner, drafter, num_speculative_tokens
        self.taps = tuple(drafter.config.target_layer_ids)
        self.stats = SpecStats()
        self.adaptive, self.cost = adaptive, VerifyCost()
        self.fused = None  # a `verify_draft.VerifyDraft` for the steps it fits (the engine's, with CUDA graphs)

    def wants_drafts(self, seq) -> bool:
        """The drafter runs for free-text requests; a grammar or logprobs request decodes a token a step."""
        return seq.matcher is None and not seq.params.logprobs

    @torch.inference_mode()
    def run(self, seqs: list, counts: list[int]) -> list[tuple[int, list[TokenLogprob]]]:
        """Feed each sequence's pending tokens and its drafts (`counts[i]` = pending fed + drafts); returns
        per sequence the positions now computed and its new tokens (none for a sequence mid-prompt)."""
        if self.fused is not None and self.fused.fits(seqs, counts):
            return self.fused.run(seqs, counts)
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
                kept, bonus = accept(rows, s.draft.ids[:k], s.params, s.draft.probs, runner.generator_for(s))
                self.stats.record(k, kept)
                tokens = [TokenLogprob(t, 0.0) for t in s.draft.ids[:kept]] + [TokenLogprob(bonus, 0.0)]
                out.append((n - k + kept, tokens))
            else:
                out.append((n, [drawn[i]] if i in drawn else []))
        features = self.drafter.context_features(tapped)  # every row at once; a sequence keeps its kept ones
        for i, s in enumerate(seqs):
            first = ends[i] - counts[i]
            s.draft.extend(starts[i], features[first:first + out[i][0]], self.drafter.config.sliding_window)
            s.draft.clear_drafts()
        self.cost.record(sum(counts), time.perf_counter() - started)  # the tokens' values waited for: a full step
        self._propose([(s, toks[-1].token_id, starts[i] + computed) for i, (s, (computed, toks))
                       in enumerate(zip(seqs, out)) if toks and self.wants_drafts(s)])
        return out

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
        dev, window = self.runner.device, self.drafter.config.sliding_window
        k = self.k
        width = min(window, max(len(s.draft.context) for s, _, _ in items))
        context = torch.zeros(len(items), width, self.drafter.config.hidden_size, dtype=self.drafter.dtype,
                              device=dev)
        valid = torch.zeros(len(items), width, dtype=torch.bool, device=dev)
        for j, (s, _, pos) in enumerate(items):
            ctx = s.draft.context[-width:] if s.draft.end == pos else s.draft.context[:0]
            if len(ctx):
                context[j, width - len(ctx):] = ctx
                valid[j, width - len(ctx):] = True
        first = torch.tensor([t for _, t, _ in items], device=dev)
        starts = torch.tensor([p for _, _, p in items], device=dev)
        logits = self.runner._in_vocab(self.drafter.block_logits(first, starts, context, valid, block_size=k + 1))
        for j, (s, _, _) in enumerate(items):
            p = s.params
            if p.greedy:
                probs = logits[j].softmax(-1)
                ids = logits[j].argmax(-1)
                s.draft.ids, s.draft.probs = ids.tolist(), None
            else:
                probs = request_probs(logits[j], p)
                ids = torch.multinomial(probs.float(), 1, generator=self.runner.generator_for(s))[:, 0]
                s.draft.ids, s.draft.probs = ids.tolist(), probs
            s.draft.confidence = probs.gather(1, ids[:, None])[:, 0].tolist()


def limit_drafts(seq, budget: int, max_model_len: int) -> int:
    """How many of `seq`'s drafts a step can feed: within the step's token budget (one token is its last
    one), the context length and its remaining `max_tokens` (the bonus token always comes too)."""
    room = min(budget - 1, max_model_len - seq.num_tokens - 1, seq.params.max_tokens - seq.num_output_tokens - 1)
    return max(0, min(len(seq.draft.ids) if seq.draft else 0, room))

