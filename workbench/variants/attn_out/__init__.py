"""`attn_out`: output gate, then the output projection.

Contract: `attn_out(o, g, w) -> y`; o [N, heads, hd] attention output, g [N, heads*hd] gate
projection, w {"gate_bias": [heads], "o_proj": [hidden, heads*hd]}. out_h = o_h * sigmoid(g_h + b_h)
(bias broadcast over the head's channels) in FP32, rounded once, then o_proj: y [N, hidden]
(a partial sum per rank under tensor parallelism).
"""

import torch

from beam_model.functional import linear
from workbench.points import Call, PointSpec, declare
from workbench.registry import register
from workbench.variants.inputs import DTYPE_BYTES, Rand, weight_bytes

QUANTIZED = {"fp8": ("o_proj",)}


@register("attn_out", "torch", "torch")
def attn_out(o, g, w):
    n, heads, hd = o.shape
    gate = torch.sigmoid(g.float().view(n, heads, hd) + w["gate_bias"].float()[None, :, None])
    gated = (o.float() * gate).to(o.dtype).reshape(n, heads * hd)
    return linear(gated, w["o_proj"])


# ---- spec: inputs, roofline and tolerance for the harness ------------------------------------------


def inputs(wl, device, seed):
    c, r = wl.config, Rand("attn_out", wl, device, seed)
    n = wl.tokens
    w = {"gate_bias": r.normal(c.num_attention_heads), "o_proj": r.linear(c.hidden_size, c.q_width)}
    return Call((r.normal(n, c.num_attention_heads, c.head_dim), r.normal(n, c.q_width), w), weights_arg=2)


def _bytes(wl):
    c = wl.config
    return DTYPE_BYTES[wl.dtype] * (2 * wl.tokens * c.q_width + c.num_attention_heads + wl.tokens * c.hidden_size) \
        + weight_bytes(wl, QUANTIZED, c.hidden_size, c.q_width)


declare(PointSpec(
    "attn_out", inputs, bytes=_bytes,
    flops=lambda wl: 2 * wl.tokens * wl.config.q_width * wl.config.hidden_size + 4 * wl.tokens * wl.config.q_width,
    tolerance={"fp32": 1e-5, "fp16": 1e-3, "bf16": 8e-3},  # ~2.5x the reference's worst vs FP64
    # per-token E4M3 activations (its fp8_scaled_mm): 2x the worst norm-wise error measured on FP8 weights,
    # random and beam-mini's on text (runs/fp8-activation-error-cpu/errors.json)
    activation_tolerance={"fp8": 0.06},
    quantized=QUANTIZED,
))
