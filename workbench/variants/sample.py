"""`sample`: next-token choice from FP32 logits.

Contract: `sample(logits, temperature, top_k, top_p, *, generator=None) -> ids`; logits [N, V]
FP32; per row: temperature [N] FP32 (0 = greedy argmax), top_k [N] int (0 = off), top_p [N] FP32
(1 = off). Top-k is applied before top-p (the most likely token always survives), then one draw
from the renormalised distribution by the exponential-race (Gumbel-max) trick, reproducible for a
given `generator`. No host syncs. Returns ids [N] int64.
"""

import torch

from workbench.registry import register


@register("sample", "torch", "torch")
def sample(logits, temperature, top_k, top_p, *, generator=None):
    greedy = logits.argmax(-1)
    scaled = logits.float() / temperature.clamp(min=1e-6)[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = (top_k[:, None] > 0) & (ranks >= top_k[:, None])
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    drop |= (probs.cumsum(-1) - probs) > top_p[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    race = torch.empty_like(probs).exponential_(generator=generator)
    choice = (probs / race).argmax(-1, keepdim=True)
    sampled = order.gather(1, choice).squeeze(1)
    return torch.where(temperature > 0, sampled, greedy)
