"""`route`: DeepSeek-V3 `noaux_tc` routing in FP32.

Contract: `route(x, w, *, n_group, topk_group, top_k, scale) -> (ids, weights)`.
- x [N, hidden] model dtype; w {"weight": [experts, hidden] FP32, "bias": [experts] FP32}.
- logits = x.float() @ weight.T (FP32); s = sigmoid(logits); selection on s + bias: experts form
  n_group groups, a group scores the sum of its top-2 biased scores, the best topk_group groups
  stay, then the top_k experts among them. Weights are the *unbiased* s at those experts,
  renormalised to sum 1, times `scale`.
- ids [N, top_k] int64 (order free: gates compare sets), weights [N, top_k] FP32 aligned with ids.
"""

import itertools

import torch

from workbench.points import Call, PointSpec, declare
from workbench.registry import register
from workbench.variants.inputs import DTYPE_BYTES, Rand


@register("route", "torch", "torch")
def route(x, w, *, n_group, topk_group, top_k, scale):
    scores = torch.sigmoid(x.float() @ w["weight"].float().t())
    biased = scores + w["bias"].float()
    n, experts = biased.shape
    group_scores = biased.view(n, n_group, -1).topk(2, dim=-1).values.sum(-1)
    kept_groups = group_scores.topk(topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    expert_mask = group_mask.repeat_interleave(experts // n_group, dim=1)
    ids = biased.masked_fill(~expert_mask, float("-inf")).topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    return ids, weights / weights.sum(-1, keepdim=True) * scale


# ---- spec: inputs, roofline and tolerance for the harness ------------------------------------------

# Biased scores closer than this (in the FP64 recomputation) are a genuine tie: FP32 summation
# order alone can flip them, so either choice is right. FP32 router logits at hidden 5120 carry
# errors ~1e-6; a router computed in BF16/TF32 errs ~1e-3 and is caught.
TIE_EPS = 1e-5


def _inputs(wl, device, seed):
    c, r = wl.config, Rand("route", wl, device, seed)
    w = {"weight": r.linear(c.n_routed_experts, c.hidden_size, dtype=torch.float32),
         "bias": r.normal(c.n_routed_experts, std=0.05, dtype=torch.float32)}
    kw = dict(n_group=c.n_group, topk_group=c.topk_group, top_k=c.num_experts_per_tok, scale=c.routed_scaling_factor)
    return Call((r.normal(wl.tokens, c.hidden_size), w), kw, weights_arg=1)


def valid_choice(biased, ids, n_group, topk_group, top_k):
    """Whether `ids` is the noaux_tc choice for one row of FP64 biased scores, up to ties within TIE_EPS.

    The ids' own groups must be kept; when they span fewer than topk_group groups, any fill of the
    remaining kept groups that is itself a valid group choice will do (two groups scoring within
    TIE_EPS are a tie: a variant may keep either, and only the kept groups' experts compete)."""
    experts = biased.shape[0]
    size = experts // n_group
    if len(set(ids)) != top_k or not all(0 <= e < experts for e in ids):
        return False
    group_scores = biased.view(n_group, size).topk(2, dim=-1).values.sum(-1)
    groups = sorted({e // size for e in ids})
    if len(groups) > topk_group:
        return False
    rest = [g for g in range(n_group) if g not in groups]
    for fill in itertools.combinations(rest, topk_group - len(groups)):
        kept = groups + list(fill)
        dropped = [g for g in rest if g not in fill]
        if dropped and group_scores[kept].min() < group_scores[dropped].max() - TIE_EPS:
            continue
        others = [e for g in kept for e in range(g * size, (g + 1) * size) if e not in ids]
        if not others or biased[ids].min() >= biased[others].max() - TIE_EPS:
            return True
    return False


def _compare(call, out, ref, tol, run=None):
    """Id sets exact per token (ties within TIE_EPS aside); weights per id against FP64."""
    x, w = call.args
    ids, weights = out
    if ids.dtype != torch.int64 or weights.dtype != torch.float32:
        return [("route_ids", None, None, False, f"ids {ids.dtype}, weights {weights.dtype}: want int64, float32")]
    scores = torch.sigmoid(x.double() @ w["weight"].double().t()).cpu()
    biased = scores + w["bias"].double().cpu()
    got, want = ids.cpu(), ref[0].cpu()
    differ = (got.sort(-1).values != want.sort(-1).values).any(-1).nonzero().flatten().tolist()
    kw = {k: call.kwargs[k] for k in ("n_group", "topk_group", "top_k")}
    wrong = [n for n in differ if not valid_choice(biased[n], got[n].tolist(), **kw)]
    # Expected weights at the candidate's own ids, so rows that differ by a tie are checked too.
    picked = scores.gather(1, got.clamp(0, scores.shape[1] - 1))
    expected = picked / picked.sum(-1, keepdim=True) * call.kwargs["scale"]
    err = ((weights.cpu().double() - expected).norm() / expected.norm()).item()
    return [("route_ids", float(len(wrong)), 0.0, not wrong,
             f"tokens {wrong[:8]} pick other experts" if wrong else f"{len(differ)} token(s) differ by a tie"),
            ("route_weights", err, tol, err <= tol, "weights at the chosen ids vs FP64")]


def _bytes(wl):
    c, n = wl.config, wl.tokens
    return DTYPE_BYTES[wl.dtype] * n * c.hidden_size + 4 * c.n_routed_experts * (c.hidden_size + 1) \
        + 12 * n * c.num_experts_per_tok


# Routing is FP32 whatever the model dtype: one tolerance for all.
declare(PointSpec(
    "route", _inputs, bytes=_bytes,
    flops=lambda wl: 2 * wl.tokens * wl.config.hidden_size * wl.config.n_routed_experts,
    tolerance={"fp32": 1e-5, "fp16": 1e-5, "bf16": 1e-5},
    compare=_compare,
))
