"""The engine: requests in, one step at a time, outputs out. Synchronous and single-threaded.

`Engine(model, tokenizer, ...)` wires a block manager (page ownership), a scheduler (who runs this
step) and a model runner (the step itself); `add_request` / `abort` / `step` are all it does.
`variants=` / `variant_configs=` re-bind the model's fusion-point variants (a lock file's
selection and tuning configs). A model step that fails runs each of its sequences alone once and
fails only the requests that fail alone, never the engine; pages always go back. Must never be
called from two threads at once (`AsyncEngine` owns it from one thread).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from beam_model.config import FULL, SLIDING
from beam_model.kv_cache import PAGE_SIZE
from server.engine import cache_sizing, first_use
from server.engine.block_manager import GROUPS, BlockManager
from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.grammar import Grammars
from server.engine.model_runner import ModelRunner, logits_width
from server.engine.output import RequestOutput
from server.engine.sampling_params import SamplingParams
from server.engine.scheduler import Scheduler
from server.engine.sequence import Sequence
from server.engine.speculative import Speculator, limit_drafts
from server.engine.verify_draft import VerifyDraft
from workbench.registry import binds

log = logging.getLogger("beam.engine")


def step_kind(seqs: list, counts: list[int]) -> str:
    """What a step feeds: `decode` (every sequence one token after its prompt), `verify` (every sequence
    past its prompt, some with drafts after their last token), `prefill` (prompt tokens only) or `mixed`."""
    decoding = [s.num_computed >= s.num_prompt_tokens for s in seqs]
    if all(decoding):
        return "decode" if all(n == 1 for n in counts) else "verify"
    return "prefill" if not any(decoding) else "mixed"


# Captured decode graphs have page tables this many tokens wide: the reference attention reads the
# whole table every step, so wider costs every step; longer sequences decode eagerly instead.
GRAPH_MAX_LEN = 8192
# `Engine.warm_up`'s prompt lengths. Triton specialises an integer argument by whether it is 1 or a
# multiple of 16, and a step's routed pairs (8 a token) are a multiple of 16 when its token count is
# even: 17, 18 and 32 tokens meet every class of (tokens, pairs); one token is a decode step, captured
# in a CUDA graph. Longer prompts take other regimes (route's tensor-core path above 96 tokens, other
# attention and experts kernels: docs/decisions.md #29), so the same
# classes again at WARM_UP_LONG_TOKENS (or the largest multiple of 16 a step's token budget allows).
WARM_UP_PROMPT_TOKENS = (17, 18, 32)
WARM_UP_LONG_TOKENS = 1024
# A step slower than this is logged with its shape (kind, sequences, tokens fed by each)
SLOW_STEP_SECONDS = 1.0


class Engine:
    def __init__(self, model, tokenizer, *, variants: dict | None = None, variant_configs: dict | None = None,
                 num_pages: int | None = None, num_sliding_pages: int | None = None,
                 gpu_memory_utilization: float = 0.9,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 prefix_caching: bool = True, cuda_graphs: bool | None = None, seed: int = 0,
                 logits_hook=None, on_runner_plan=None, drafter=None, num_speculative_tokens: int | None = None,
                 adaptive_verification: bool = False, drafter_variants: dict | None = None,
                 drafter_variant_configs: dict | None = None):
        """`drafter`: a `beam_model.drafter.BeamDrafter` attached to `model`: decode steps verify its
        drafts (`num_speculative_tokens` a step, default its block's; with `adaptive_verification`, as
        many as its confidence and the measured step cost say are worth it) and it proposes the next
        ones (engine/speculative.py). Its points run the model's variants unless `drafter_variants` (and
        `drafter_variant_configs`) name its own (a lock made at the draft-b1 target)."""
        own = drafter_variants is not None or drafter_variant_configs is not None
        builds = [(model, variants, variant_configs),
                  (drafter, *((drafter_variants, drafter_variant_configs) if own else (variants, variant_configs)))]
        for m, selection, configs in builds:  # a lock's selection and tuning configs
            # Binding prepares the weights anew: a model (or drafter) that another engine bound to the same
            # build keeps its prepared weights, which that engine's captured graphs read.
            given = selection is not None or configs is not None
            if m is not None and given and not binds(m.ops, selection, configs):
                m.set_variants(selection, configs)
        cuda = model.device.type == "cuda"
        self.model, self.tokenizer, self.config = model, tokenizer, model.config
        self.vocab_size = logits_width(model)
        self.max_num_seqs = max_num_seqs or (256 if cuda else 128)
        self.max_num_batched_tokens = max_num_batched_tokens or (2048 if cuda else 1024)
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        self.page_size = PAGE_SIZE
        c = self.config
        # The sliding pages hold what any reader needs: the target's window before its next query, and
        # with a drafter also its window before the block it drafts at that query's position
        self.window = max(c.sliding_window, drafter.config.sliding_window + 1 if drafter is not None else 0)
        self.num_pages = self._plan_pages(num_pages, num_sliding_pages, gpu_memory_utilization, drafter)
        enabled = {g: any(t == g for t in c.layer_types) for g in GROUPS}
        self.block_manager = BlockManager(self.num_pages, page_size=self.page_size, window=self.window,
                                          enabled=enabled, prefix_caching=prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=self.max_num_seqs,
                                   max_num_batched_tokens=self.max_num_batched_tokens)
        self.max_model_len = min(c.max_position_embeddings, (self.num_pages[FULL] - 1) * self.page_size)
        # What the runner is built from: the other ranks of a tensor-parallel group build theirs from it
        # (`on_runner_plan`, before this one captures its graphs, whose collectives they must meet)
        graphs = cuda if cuda_graphs is None else cuda_graphs
        self.runner_plan = dict(num_pages=self.num_pages, page_size=self.page_size, max_num_seqs=self.max_num_seqs,
                                vocab_limit=min(self.vocab_size, tokenizer.vocab_size),
                                # with a drafter, its steps have graphs of their own (VerifyDraft)
                                cuda_graphs=graphs and drafter is None,
                                graph_max_len=min(self.max_model_len, GRAPH_MAX_LEN), seed=seed)
        if on_runner_plan is not None:
            on_runner_plan(self.runner_plan)
        self.runner = ModelRunner(model, **self.runner_plan, logits_hook=logits_hook)
        self.speculator = None
        if drafter is not None:
            k = num_speculative_tokens or drafter.config.block_size - 1
            self.speculator = Speculator(self.runner, drafter, k, max_num_seqs=self.max_num_seqs,
                                         adaptive=adaptive_verification)
            if graphs and cuda:  # verify + draft steps in one replay
                self.speculator.fused = VerifyDraft(self.speculator, max_num_seqs=self.max_num_seqs,
                                                    graph_max_len=self.runner_plan["graph_max_len"], graphs=True)
            self.scheduler.drafts_for = lambda seq, budget: limit_drafts(seq, budget, self.max_model_len)
        self.eos_token_id = tokenizer.eos_token_id
        self._grammars_lock = threading.Lock()
        self.requests: dict[str, Sequence] = {}
        self.num_steps = 0
        # Called on the engine thread after each model step as (kind, num_seqs, seconds, prepare,
        # device, grammar): the wall time of `ModelRunner.run`, from the step's start until its sampled tokens
        # are on the host (the runner's `.tolist()` of the samples is the only synchronization; none is
        # added), the host time it spent before launching the forward (inputs, page tables, attention
        # plans), and on CUDA the GPU time from the forward's launch to the drawn tokens (events; else
        # None), and the host time it spent filling grammar masks (None when no row had a grammar). A step
        # that samples nothing (a prompt chunk mid-prompt) is not waited for: its GPU time lands in the
        # next step. The server's metrics set this (beam_engine_step_seconds,
        # beam_engine_step_prepare_seconds, beam_engine_step_device_seconds, beam_engine_step_grammar_seconds).
        self.step_observer = None
        self.slow_step_seconds = SLOW_STEP_SECONDS  # steps slower than this are logged (warm-up: none)
        # The last step's (kind, sequences, tokens fed by each), or None when it ran no model step, and
        # the Triton kernel signatures it specialised first in this process (`first_use`)
        self.last_step: tuple[str, int, list[int]] | None = None
        self.last_first_uses: list[str] = []
        first_use.install()

    def _plan_pages(self, num_pages, num_sliding_pages, utilization, drafter) -> dict[str, int]:
        c, m, ps = self.config, self.model, PAGE_SIZE
        need = dict(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                    page_size=ps, window=self.window)
        extra = dict(sliding_extra_bytes=drafter.page_bytes(ps) if drafter is not None else 0)
        blocks = self.max_num_seqs * drafter.page_bytes(ps) if drafter is not None else 0  # a page a drafted block
        if num_pages is not None:
            sliding = cache_sizing.sliding_pages_needed(c, **need)
            pages = {FULL: num_pages, SLIDING: sliding}
        elif m.device.type == "cuda":
            if not 0 < utilization <= 1:
                raise ValueError("gpu_memory_utilization must be in (0, 1]")
            budget = cache_sizing.cuda_kv_budget(m, utilization, self.max_num_batched_tokens) - blocks
            pages = cache_sizing.plan_pages(c, m.dtype, budget, **need, **extra)
        else:
            pages = cache_sizing.plan_pages(c, m.dtype, cache_sizing.CPU_KV_BYTES - blocks, **need, **extra)
        if num_sliding_pages is not None:
            pages[SLIDING] = num_sliding_pages
        floor = cache_sizing.min_sliding_pages(c, max_num_batched_tokens=self.max_num_batched_tokens, page_size=ps,
                                               window=self.window)
        if pages[FULL] < 2 or pages[SLIDING] < floor:
            raise ValueError(f"KV pools too small: {pages[FULL]} full-attention pages (need >= 2) and "
                             f"{pages[SLIDING]} sliding pages (need >= {floor} for a chunk of "
                             f"{self.max_num_batched_tokens} tokens)")
        return pages

    # ---- requests ------------------------------------------------------------------------
    @property
    def grammars(self) -> Grammars:
        """The grammar compiler, made on the first structured request (llguidance loads then)."""
        with self._grammars_lock:
            if self.runner.grammars is None:
                self.runner.grammars = Grammars(self.tokenizer, self.vocab_size)
            return self.runner.grammars

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the request can never be served. Reads only constants and compiles the
        output's structure (cached, under a lock): thread-safe."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = min(self.vocab_size, self.tokenizer.vocab_size)
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"this model's context length is {self.max_model_len} tokens, but the request "
                             f"needs {len(prompt_ids)} prompt + {params.max_tokens} completion tokens")
        if params.structure is not None:
            self.grammars.compile(params.structure)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_request(prompt_ids, params)
        seq = Sequence(request_id, prompt_ids, params, IncrementalDetokenizer(self.tokenizer, params.stop))
        if params.structure is not None:
            seq.matcher = self.grammars.matcher(params.structure, params.thinking_token_budget)
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request now; its pages go back before this returns."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        return True

    def abort_all(self, error: str) -> list[RequestOutput]:
        outs = []
        for rid in list(self.requests):
            seq = self.requests[rid]
            self._finish(seq, "error", error)
            outs.append(self._output(seq, [], "", None))
        return outs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        outputs = []
        for seq in batch.finished:  # the scheduler ended it: no room left to grow
            self.requests.pop(seq.request_id, None)
            outputs.append(self._output(seq, [], seq.detokenizer.flush(), None))
        self.last_step, self.last_first_uses = None, []
        if not batch.seqs:
            return outputs
        self.num_steps += 1
        kind = step_kind(batch.seqs, batch.num_tokens)
        self.last_step = (kind, len(batch.seqs), list(batch.num_tokens))
        # A seeded request's generator as the step starts (the one thing a step changes in a sequence)
        seeded = [(q, None if q.generator is None else q.generator.get_state())
                  for q in batch.seqs if q.params.seed is not None]
        try:
            samples = self._run(kind, batch.seqs, batch.num_tokens)
        except Exception as e:  # noqa: BLE001 - one bad step must not take the server down
            if len(batch.seqs) == 1:
                log.exception("model step failed; failing its request")
                self._fail(batch.seqs[0], e, outputs)
                return outputs
            # One request can break a whole step: run each alone once, so only those that fail alone fail
            log.warning("model step of %d sequences failed (%s: %s); running each alone", len(batch.seqs),
                        type(e).__name__, e)
            for q, state in seeded:  # the failed step may have drawn: draw again from where it started
                if state is None:
                    q.generator = None
                else:
                    q.generator.set_state(state)
            samples = [self._run_alone(q, n, outputs) for q, n in zip(batch.seqs, batch.num_tokens)]
        for seq, (computed, tokens) in zip(batch.seqs, samples):
            if seq.finished:  # failed alone
                continue
            seq.num_computed += computed
            self.block_manager.commit(seq)
            self.block_manager.trim(seq)  # the pages of drafts not kept
            if tokens:
                outputs.append(self._append(seq, tokens))
        if self.speculator is not None:  # drafts after the tokens as they stand (stops, grammars applied)
            drafting = [seq for seq, (_, tokens) in zip(batch.seqs, samples) if tokens]
            try:
                self.speculator.propose(drafting)
            except Exception:  # noqa: BLE001 - drafts are optional: the sequences decode a token a step
                log.exception("the drafter failed; %d sequences go on without drafts", len(drafting))
                for seq in drafting:
                    if seq.draft is not None:
                        seq.draft.clear_drafts()
        return outputs

    def _run(self, kind: str, seqs: list, counts: list[int]) -> list:
        """One model step, timed, observed and logged when slow."""
        first_use.take()  # what compiled between steps is no step's
        started = time.perf_counter()
        samples = self._model_step(seqs, counts)
        seconds = time.perf_counter() - started
        self.last_first_uses = first_use.take()
        if seconds > self.slow_step_seconds:  # a first-seen shape compiling, most often: say which
            log.warning("slow %s step: %.2f s for %d sequences, tokens fed %s%s", kind, seconds, len(seqs), counts,
                        f"; Triton kernels first specialised in it: {first_use.summary(self.last_first_uses)}"
                        if self.last_first_uses else "")
            for signature in self.last_first_uses:
                log.debug("first specialised: %s", signature)
        if self.step_observer is not None:
            masks = self.runner.masks
            self.step_observer(kind, len(seqs), seconds, self.runner.last_prepare_seconds,
                               self.runner.last_device_seconds, masks.last_seconds if masks.last_constrained else None)
        return samples

    def _model_step(self, seqs: list, counts: list[int]) -> list[tuple[int, list]]:
        """Per sequence, the positions the step computed and its new tokens (none mid-prompt)."""
        if self.speculator is not None:
            return self.speculator.run(seqs, counts)
        return [(n, [] if t is None else [t]) for n, t in zip(counts, self.runner.run(seqs, counts))]

    def _run_alone(self, seq: Sequence, n: int, outputs: list):
        """`seq`'s part of a failed step on its own (`_model_step`'s), or (0, []) if it fails (and it is
        failed)."""
        try:
            return self._model_step([seq], [n])[0]
        except Exception as e:  # noqa: BLE001 - this request's own failure
            log.exception("request %s fails on its own too; failing it", seq.request_id)
            self._fail(seq, e, outputs)
            return 0, []

    def _fail(self, seq: Sequence, error: Exception, outputs: list) -> None:
        self._finish(seq, "error", f"model step failed: {type(error).__name__}: {error}")
        outputs.append(self._output(seq, [], "", None))

    def _append(self, seq: Sequence, samples: list) -> RequestOutput:
        """A step's new tokens of `seq` (several where drafts were kept), up to the one that ends it."""
        ids, text, logprobs = [], "", []
        for sample in samples:
            piece = self._append_one(seq, sample)
            if seq.error:
                return self._output(seq, [], "", None)
            ids.append(sample.token_id)
            text += piece
            logprobs.append(sample)
            if seq.finished:
                break
        return self._output(seq, ids, text, logprobs if seq.params.logprobs else None)

    def _append_one(self, seq: Sequence, sample) -> str:
        """One new token of `seq`: the text it releases (finishing `seq` where it ends it)."""
        tid, p = sample.token_id, seq.params
        if seq.matcher is not None and not seq.matcher.accept(tid):  # drawn under its mask: a sampler's fault
            self._finish(seq, "error", f"token {tid} breaks the output's grammar (the sampler ignored its mask)")
            return ""
        seq.token_ids.append(tid)
        stop_token = (tid == self.eos_token_id and not p.ignore_eos) or tid in p.stop_token_ids
        text = "" if stop_token else seq.detokenizer.add(tid)  # a stop token's text is never shown
        reason = None
        if stop_token or seq.detokenizer.stopped:
            reason = "stop"
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason:
            text += seq.detokenizer.flush()
            self._finish(seq, reason)
        return text

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        self.requests.pop(seq.request_id, None)
        self.scheduler.finish(seq, reason)
        seq.error = error

    @staticmethod
    def _output(seq: Sequence, token_ids, text, logprobs) -> RequestOutput:
        return RequestOutput(seq.request_id, token_ids, text, logprobs, seq.finished, seq.finish_reason,
                             seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_tokens or 0, seq.error)

    # ---- start-up ------------------------------------------------------------------------------
    def warm_up(self) -> int:
        """Run the step kinds a server meets with its first requests once, before any request, so
        their kernels compile at start-up rather than inside a user's prompt: Triton compiles a
        kernel again for each class of its integer arguments (1, a multiple of 16, any other), and
        a mixed step (prompt tokens beside decoding sequences) takes other shapes than a prompt
        alone (docs/decisions.md #29: a mixed step compiles kernels a prompt alone does not). For
        a prompt of each length of `warm_up_lengths`: the prompt alone, then a prompt of one token
        fewer beside its decode (a mixed step of the same count), each greedy to 3 tokens. Leaves
        no request running; the KV pages go back (prefix-cached). Raises if a step fails: a model
        that cannot run these would fail its first requests. Returns the steps it ran."""
        vocab = min(self.vocab_size, self.tokenizer.vocab_size)
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        steps, slow = self.num_steps, self.slow_step_seconds
        self.slow_step_seconds = float("inf")  # compiling is what these steps are for
        try:
            self._warm_up(vocab, params)
        finally:
            self.slow_step_seconds = slow
        return self.num_steps - steps

    def warm_up_lengths(self, max_tokens: int = 3) -> list[int]:
        """The prompt lengths `warm_up` runs: WARM_UP_PROMPT_TOKENS, then the long scale's three
        classes (odd, even, a multiple of 16) where a step's token budget and the context allow."""
        long = min(WARM_UP_LONG_TOKENS, (self.max_num_batched_tokens - 2) // 16 * 16)
        lengths = list(WARM_UP_PROMPT_TOKENS)
        if long > max(lengths):
            lengths += [long + 1, long + 2, long]
        # a context this short never sees such prompts
        return [n for n in lengths if n + max_tokens <= self.max_model_len]

    def _warm_up(self, vocab: int, params: SamplingParams) -> None:
        for n in self.warm_up_lengths(params.max_tokens):
            first, second = f"warm-up-{n}", f"warm-up-{n}-mixed"
            self.add_request(first, [(7 * i + n) % vocab for i in range(n)], params)
            outputs = self.step()  # the prompt alone
            self.add_request(second, [(11 * i + n + 1) % vocab for i in range(n - 1)], params)
            while self.has_unfinished():  # the first step: the second prompt beside the first's decode
                outputs += self.step()
            failed = [o.error for o in outputs if o.error]
            if failed:
                raise RuntimeError(f"warm-up step failed ({n}-token prompts): {failed[0]}")

    # ---- introspection & offline use --------------------------------------------------------
    def stats(self) -> dict:
        bm, s = self.block_manager, self.scheduler
        return {
            "running": len(s.running), "waiting": len(s.waiting),
            "pages_used": {g: bm.used(g) for g in GROUPS},
            "pages_cached": {g: bm.cached(g) for g in GROUPS},
            "pages_total": {g: bm.capacity(g) for g in GROUPS},
            "prefix_queried_tokens": s.prefix_queried_tokens, "prefix_hit_tokens": s.prefix_hit_tokens,
            "preemptions": s.num_preemptions, "steps": self.num_steps,
            "speculative": dataclasses.asdict(self.speculator.stats) if self.speculator else None,
        }

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Serve prompts to completion (all concurrently); returns each one's generated ids."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{i}-{id(prompts)}" for i in range(len(prompts))]
        out: dict[str, list[int]] = {r: [] for r in ids}
        for r, p, sp in zip(ids, prompts, params):
            self.add_request(r, p, sp)
        while self.has_unfinished():
            for o in self.step():
                out[o.request_id].extend(o.token_ids)
                if o.error:
                    raise RuntimeError(o.error)
        return [out[r] for r in ids]
