"""Optimization targets: one engine step of a given shape, run exactly as the server would run it.

A target is a batch shape (`decode-b1`: one sequence decoding one token over 4K tokens of
context; `prefill-8x2k`: eight 2048-token prompts; `verify-b1`: a speculative decoding step, the last
token and 15 drafts verified over 4K tokens of context, logits at all 16, each token a decode row of its
sequence as the engine's graphed verify step feeds a block; `draft-b1`: a DFlash drafter's block of 16
after 4K tokens, its points bound with the model's). `StepRunner` builds the step once for a model
(the KV cache pre-filled with random history, so no prompt has to be run through the model), then
`runner()` runs it: decode and verify blocks replay a CUDA graph on GPU (as the server's do), prefill
runs eagerly. Rebinding variants (`rebind`) re-captures without rebuilding the model, which matters for
a 125 GB rank. This module never times anything itself (that is `workbench.bench`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from beam_model.kv_cache import GROUPS, PagedKVCache, build_step_metadata
from workbench.points import Workload
from workbench.registry import without_cache_pdl


@dataclass(frozen=True)
class Target:
    name: str
    batch: int
    tokens_per_seq: int  # 1 = decode
    context: int         # KV tokens per sequence before the step
    all_logits: bool = False  # logits at every new token (a verify step), not only at the last
    # each new token a decode row with its sequence's page table at its own position (the engine's verify)
    decode_rows: bool = False
    # the drafter's step: a block of tokens_per_seq (the last accepted token and its drafts) proposed by a
    # DFlash drafter for the model (random weights, the default drafter shape), its context a full window
    draft: bool = False

    @property
    def decode(self) -> bool:
        return self.tokens_per_seq == 1

    @property
    def graphed(self) -> bool:
        """Whether the server replays this step from a CUDA graph: decode steps, verify blocks and the
        drafting after them."""
        return self.decode or self.decode_rows or self.draft

    def workload(self, preset: str, dtype: str, layer_kind: str, weights: str = "bf16") -> Workload:
        """The shapes one fusion-point call sees in this step, in a "sliding" or "full" layer, or after
        the last one ("model": head and sample, on each sequence's last new token), the projections
        stored as `weights`."""
        rows = 1 if layer_kind == "model" and not (self.all_logits or self.draft) else self.tokens_per_seq
        if self.decode_rows:  # the points see b * t decode rows
            return Workload(preset=preset, batch=self.batch * rows, tokens_per_seq=1,
                            context=self.context + self.tokens_per_seq,
                            layer="full" if layer_kind == "full" else "sliding", dtype=dtype, weights=weights)
        return Workload(preset=preset, batch=self.batch, tokens_per_seq=rows,
                        context=self.context + self.tokens_per_seq,
                        layer="full" if layer_kind == "full" else "sliding", dtype=dtype, weights=weights)


TARGETS = {
    "decode-b1": Target("decode-b1", 1, 1, 4096),
    "decode-b8": Target("decode-b8", 8, 1, 4096),
    "decode-b64": Target("decode-b64", 64, 1, 4096),
    "prefill-8x2k": Target("prefill-8x2k", 8, 2048, 0),
    # Speculative decoding's verify step (engine/speculative.py): a DFlash block of 16 tokens
    "verify-b1": Target("verify-b1", 1, 16, 4096, all_logits=True, decode_rows=True),
    "verify-b8": Target("verify-b8", 8, 16, 4096, all_logits=True, decode_rows=True),
    # Its drafter's step: the drafter's points are called outside the model's layers ("model" calls)
    "draft-b1": Target("draft-b1", 1, 16, 4096, draft=True),
}
# Shapes the CPU default runs at: beam-tiny keeps every structural feature at toy sizes.
CPU_CONTEXT = 96
CPU_PREFILL = 48


def get_target(name: str) -> Target:
    if name not in TARGETS:
        raise KeyError(f"unknown target {name!r}; targets: {', '.join(TARGETS)}")
    return TARGETS[name]


def for_device(target: Target, device: torch.device) -> Target:
    """On CPU, shrink the step so the embedded default finishes in seconds."""
    if device.type == "cuda":
        return target
    tokens = 1 if target.decode else min(target.tokens_per_seq, CPU_PREFILL)
    return replace(target, batch=min(target.batch, 8), tokens_per_seq=tokens, context=min(target.context, CPU_CONTEXT))


class StepRunner:
    """One target step on one model; `runner()` runs it, `runner.rebind(selection)` swaps variants."""

    def __init__(self, model, target: Target, *, use_graph: bool | None = None, seed: int = 0, drafter=None):
        """`drafter`: a draft target's drafter (attached to `model`; default: a random one of the default
        shape)."""
        self.model, self.target = model, target
        device = model.device
        self.use_graph = (device.type == "cuda" and target.graphed) if use_graph is None else use_graph
        gen = torch.Generator(device=device).manual_seed(seed)
        b, t = target.batch, target.tokens_per_seq
        total = target.context + t
        self.cache = PagedKVCache.for_sequences(model.config, [total] * b, dtype=model.dtype, device=device)
        for s in range(b):
            self.cache.add(s)
        if target.context:
            # History as random K/V: attention reads realistic data without running a prefill.
            self.cache.prepare_step(list(range(b)), [target.context] * b)
            for storage in self.cache.storage.values():
                storage.normal_(generator=gen)
        self.step = self.cache.prepare_step(list(range(b)), [t] * b)
        if target.decode_rows:
            pages = {g: [self.cache.pages(s, g) for s in range(b) for _ in range(t)] for g in GROUPS}
            starts = [target.context + j for _ in range(b) for j in range(t)]
            self.step = build_step_metadata(pages, starts, [1] * (b * t), page_size=self.cache.page_size,
                                            device=device)
        self.input_ids = torch.randint(0, model.config.vocab_size, (b * t,), device=device, generator=gen)
        rows = b * t if target.all_logits else b
        self.sampling = dict(temperature=torch.zeros(rows, device=device), top_k=torch.zeros(rows, dtype=torch.long,
                             device=device), top_p=torch.ones(rows, device=device))
        self.drafter = _drafter_step_inputs(self, gen, drafter) if target.draft else None
        self.graph = None
        self.output = None
        self._step = self._eager
        self._capture()

    def _eager(self) -> torch.Tensor:
        if self.drafter is not None:  # the engine's drafter side of a verify step, greedy
            tapped, positions, slots = self.draft_fed
            fed = (self.drafter.context_features(tapped), positions, slots)
            return self.drafter.block_logits(*self.draft_inputs, fed=fed).argmax(-1)
        logits = self.model.step(self.input_ids, self.cache, self.step, all_logits=self.target.all_logits)
        return self.model.ops.sample(logits, **self.sampling)

    @torch.inference_mode()
    def _capture(self) -> None:
        self.graph = None
        if not self.use_graph:
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up (lazy compiles, autotuning) outside the graph
                self._step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = self._step()

    def rebind(self, selection: dict[str, str] | None, configs: dict[str, dict] | None = None, *,
               compile_mode: str | None = None) -> None:
        """Bind the variants and capture the step again. `compile_mode`: run the whole step through
        torch.compile in that mode (as a user would compile the model), else eagerly op by op."""
        if self.target.decode_rows or self.target.draft:
            configs = without_cache_pdl(configs)  # as the engine's verify + draft graphs run them
        self.model.set_variants(selection, configs)
        if self.drafter is not None:
            self.drafter.use_ops(self.model.ops)
        self._step = torch.compile(self._eager, mode=compile_mode, dynamic=False) if compile_mode else self._eager
        self._capture()  # on the GPU its warm-up compiles; eagerly the timing's warm-up calls do

    @torch.inference_mode()
    def __call__(self) -> torch.Tensor:
        if self.graph is not None:
            self.graph.replay()
            return self.output
        self.output = self._step()
        return self.output


def _drafter_step_inputs(runner: StepRunner, gen: torch.Generator, drafter=None):
    """The drafter (`drafter`, else one for the runner's model: random weights in its dtype), bound to the
    model's points, and its side of a verify step as the engine's graph runs it: the block after each
    sequence's last token at position `context`, reading a full window of random keys before it, whose
    layers also write the keys of the step's fed rows (random tapped hidden states)."""
    from beam_model.drafter import ContextKV
    from beam_model.drafter_config import DrafterConfig
    from workbench.training.drafter import converted, initial_drafter

    model, target = runner.model, runner.target
    if drafter is None:
        config = DrafterConfig.for_target(model.config, block_size=target.tokens_per_seq)
        drafter = converted(initial_drafter(config, model, seed=0, device=model.device), model.dtype)
    config = drafter.config
    drafter.use_ops(model.ops)
    b, t, c_len, dev = target.batch, target.tokens_per_seq, config.sliding_window, model.device
    page = max(c_len, t)
    store = drafter.context_store(2 * b, page)  # a page of the window per sequence, then one for its block
    for layer in store:
        layer.normal_(generator=gen)
    tapped = torch.randn(b * t, config.feature_width, device=dev, generator=gen).to(model.dtype)
    fed = torch.arange(t, device=dev)  # the fed rows: positions context - t .. context - 1, the window's last
    runner.draft_fed = (tapped, (target.context - t + fed).clamp(min=0).repeat(b),
                        (torch.arange(b, device=dev)[:, None] * page + c_len - t + fed).reshape(-1))
    window = torch.arange(c_len, device=dev).expand(b, c_len)
    context = ContextKV(store, torch.arange(b, device=dev)[:, None].expand(b, c_len), window,
                        window >= c_len - min(c_len, target.context), b + torch.arange(b, device=dev))
    runner.draft_inputs = (runner.input_ids[:b], torch.full((b,), target.context, device=dev), context)
    return drafter
