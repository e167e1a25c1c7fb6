"""`attn_out`: output gate, then the output projection.

Contract: `attn_out(o, g, w) -> y`; o [N, heads, hd] attention output, g [N, heads*hd] gate
projection, w {"gate_bias": [heads], "o_proj": [hidden, heads*hd]}. out_h = o_h * sigmoid(g_h + b_h)
(bias broadcast over the head's channels) in FP32, rounded once, then o_proj: y [N, hidden]
(a partial sum per rank under tensor parallelism).
"""

import torch
import torch.nn.functional as F

from workbench.registry import register


@register("attn_out", "torch", "torch")
def attn_out(o, g, w):
    n, heads, hd = o.shape
    gate = torch.sigmoid(g.float().view(n, heads, hd) + w["gate_bias"].float()[None, :, None])
    gated = (o.float() * gate).to(o.dtype).reshape(n, heads * hd)
    return F.linear(gated, w["o_proj"])
