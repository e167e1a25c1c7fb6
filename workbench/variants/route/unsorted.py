"""`route:unsorted`: the reference's routing with each `topk` unsorted, as a user writes it for torch.compile.

The contract leaves the order of a token's ids free, and neither the group scores (a sum of two) nor the
kept groups (a mask) depend on an order, so no selection needs sorting. On the GPU a sorted `topk` is a
selection kernel and a sort kernel; Inductor calls ATen's `topk` as it is, so a compiled step keeps all
three sorts a MoE layer (runs/compile-baseline-layers-h100/, `bitonicSortKVInPlace`) unless the model asks
for none.
"""

import torch

from workbench.registry import register


@register("route", "unsorted", "torch")
def route_unsorted(x, w, *, n_group, topk_group, top_k, scale):
    scores = torch.sigmoid(x.float() @ w["weight"].float().t())
    biased = scores + w["bias"].float()
    n, experts = biased.shape
    group_scores = biased.view(n, n_group, -1).topk(2, dim=-1, sorted=False).values.sum(-1)
    kept_groups = group_scores.topk(topk_group, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    expert_mask = group_mask.repeat_interleave(experts // n_group, dim=1)
    ids = biased.masked_fill(~expert_mask, float("-inf")).topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    return ids, weights / weights.sum(-1, keepdim=True) * scale
