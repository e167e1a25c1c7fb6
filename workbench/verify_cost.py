"""What speculative decoding's verify step costs against the one-token decode step, and what it buys.

The target's step at batch 1 over `context` tokens of history is timed for n = 1, 2, ... new tokens
with logits at each (the verify step of the last token and n - 1 drafts), graphed on CUDA as the
server's decode is. At batch 1 the step is bound by the weights it reads, and the experts it reads
grow with the experts its n tokens route to: with random token ids they route nearly independently;
`overlap` rewrites the route point's choices so every token of the block shares that fraction of its
experts with the others (held-out text on beam-mini: consecutive tokens share ~35% of their experts,
`models/beam-mini/README.md`). From the curve, the speed-up of a drafter whose verify steps yield L
tokens on average with K drafts: L * t(1) / (t(K + 1) + t_draft), t_draft its own block step.

Adaptive verification verifies fewer drafts where more do not pay. What the best fixed number n of them
buys follows from the curve once the drafts' acceptance is modelled: each draft accepted with one
probability p while the ones before it were (the usual i.i.d. model of speculative decoding), p set so that
K drafts give L tokens, (1 - p^(K + 1)) / (1 - p) = L; then n drafts give (1 - p^(n + 1)) / (1 - p) tokens
in t(n + 1) + t_draft, against 1 token in t(1) without the drafter.
"""

from __future__ import annotations

import torch

from workbench import timing
from workbench.targets import StepRunner, Target


def shared_routing(route, share: float, num_experts: int, seed: int = 0):
    """`route` whose expert ids are replaced by ones in which every token keeps round(share * k) experts of
    the step's first token and has the rest drawn at random (ids distinct per token); the weights are the
    route's own, slot for slot. The ids are made once per step shape, in the warm-up before a graph is
    captured: the route's own kernels still run and the step gains none (a rewrite inside the step would
    add kernels to every MoE layer, which at batch 1 cost more than the shared experts save)."""
    made = {}

    def wrapped(x, w, **kw):
        ids, weights = route(x, w, **kw)
        n, k = ids.shape
        m = round(share * k)
        if m == 0 or n < 2:
            return ids, weights
        key = (n, k, ids.dtype, ids.device)
        if key not in made:
            made[key] = _shared_ids(n, k, m, num_experts, seed).to(device=ids.device, dtype=ids.dtype)
        return made[key], weights

    return wrapped


def _shared_ids(n: int, k: int, m: int, num_experts: int, seed: int) -> torch.Tensor:
    """[n, k] expert ids: the first row k random experts, every other row its first m and k - m of its own."""
    gen = torch.Generator().manual_seed(seed)
    first = torch.randperm(num_experts, generator=gen)[:k]
    rows = [first]
    for _ in range(n - 1):
        others = torch.randperm(num_experts, generator=gen)
        rows.append(torch.cat([first[:m], others[~torch.isin(others, first[:m])][:k - m]]))
    return torch.stack(rows)


def verify_curve(model, tokens: list[int], *, context: int, overlap: float | None = None,
                 budget_s: float = 2.0) -> dict[int, dict]:
    """{n: time_fn's result} for the step of n new tokens at batch 1 (logits at each)."""
    graph, route = model.device.type == "cuda", model.ops.route
    if overlap is not None:
        model.ops.route = shared_routing(route, overlap, model.config.n_routed_experts)
    try:
        curve = {}
        for n in tokens:  # fed as the engine's graphed verify step feeds a block: a decode row a token
            target = Target(f"verify-{n}", 1, n, context, all_logits=n > 1, decode_rows=True)
            curve[n] = timing.time_fn(StepRunner(model, target, use_graph=graph), device=model.device,
                                      budget_s=budget_s)
        return curve
    finally:
        model.ops.route = route


def draft_step_us(drafter, *, context: int, budget_s: float = 2.0) -> dict:
    """time_fn's result for the drafter proposing one block at batch 1 after `context` tokens, its window
    full: the `draft-b1` step (graphed on CUDA, as the engine drafts), with this drafter."""
    target = Target("draft", 1, drafter.config.block_size, context, draft=True)
    runner = StepRunner(drafter.target, target, drafter=drafter)
    return timing.time_fn(runner, device=drafter.device, budget_s=budget_s)


def projected_speedup(curve_us: dict[int, float], draft_us: float, acceptance: float, drafts: int) -> float:
    """Decode tokens per second with the drafter over without it: `acceptance` tokens per verify step of
    `drafts` drafts (plus the bonus token), each verify step followed by a draft step."""
    return acceptance * curve_us[1] / (curve_us[drafts + 1] + draft_us)


def per_draft_acceptance(length: float, drafts: int) -> float:
    """p with (1 - p^(drafts + 1)) / (1 - p) = `length` tokens per verify step (bisection; `length` in
    [1, drafts + 1])."""
    if not 1.0 <= length <= drafts + 1:
        raise ValueError(f"{length} tokens per verify step is outside 1 .. {drafts + 1} with {drafts} drafts")
    low, high = 0.0, 1.0
    for _ in range(60):
        p = (low + high) / 2
        if _tokens(p, drafts) < length:
            low = p
        else:
            high = p
    return (low + high) / 2


def best_fixed_drafts(curve_us: dict[int, float], draft_us: float, length: float, drafts: int) -> dict:
    """{"drafts", "tokens", "speedup"}: the number of drafts n (1 .. `drafts`) a step verifies whose speed-up
    over plain decoding is the highest, drafts accepted as `per_draft_acceptance(length, drafts)` models them.
    Below 1, no number of drafts pays: plain decoding is faster."""
    p = per_draft_acceptance(length, drafts)
    best = None
    for n in range(1, drafts + 1):
        tokens = _tokens(p, n)
        speedup = projected_speedup(curve_us, draft_us, tokens, n)
        if best is None or speedup > best["speedup"]:
            best = {"drafts": n, "tokens": tokens, "speedup": speedup}
    return best


def _tokens(p: float, drafts: int) -> float:
    """Tokens a verify step of `drafts` drafts yields, each accepted with probability p while the ones before it
    were: the bonus token and the accepted prefix, 1 + p + ... + p^drafts."""
    return sum(p ** i for i in range(drafts + 1))
