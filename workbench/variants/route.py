"""`route`: DeepSeek-V3 `noaux_tc` routing in FP32.

Contract: `route(x, w, *, n_group, topk_group, top_k, scale) -> (ids, weights)`.
- x [N, hidden] model dtype; w {"weight": [experts, hidden] FP32, "bias": [experts] FP32}.
- logits = x.float() @ weight.T (FP32); s = sigmoid(logits); selection on s + bias: experts form
  n_group groups, a group scores the sum of its top-2 biased scores, the best topk_group groups
  stay, then the top_k experts among them. Weights are the *unbiased* s at those experts,
  renormalised to sum 1, times `scale`.
- ids [N, top_k] int64 (order free: gates compare sets), weights [N, top_k] FP32 aligned with ids.
"""

import torch

from workbench.registry import register


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
