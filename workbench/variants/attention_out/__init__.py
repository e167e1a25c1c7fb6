"""`attention_out`: a compound point, `attention` then `attn_out` (a fusion across the two).

Contract: `attention_out(q, cache, meta, g, w, *, window, scale) -> y`; the arguments of `attention`
(q [N, heads, hd], the layer's paged KV cache, its metadata, window, scale) and of `attn_out` (g
[N, heads*hd], w {"gate_bias", "o_proj"} as the reference lays them out). y = attn_out(attention(...), g, w):
the attention output is rounded to the model dtype before the gate, as the two points do apart.

Its reference is that sequence; where a build selects it, the model runs the selected `attention` and
`attn_out` variants (registry.COMPOUNDS). A variant of its own runs both in fewer kernels: e.g. a
split-K decode's partials merged and gated in one kernel instead of a merge kernel and a gate kernel.
"""

from workbench.points import Call, PointSpec, declare, spec
from workbench.registry import References, compound_split, register
from workbench.variants import attention as attention_point
from workbench.variants import attn_out as attn_out_point
from workbench.variants.inputs import DTYPE_BYTES


@compound_split("attention_out")
def split(ops, q, cache, meta, g, w, *, window, scale):
    return ops.attn_out(ops.attention(q, cache, meta, window=window, scale=scale), g, w)


@register("attention_out", "torch", "torch")
def attention_out(q, cache, meta, g, w, *, window, scale):
    return split(References(), q, cache, meta, g, w, window=window, scale=scale)


# ---- spec: the members' inputs side by side; bytes and FLOPs add up ---------------------------------

def _inputs(wl, device, seed):
    a = attention_point.inputs(wl, device, seed)
    _, g, w = attn_out_point.inputs(wl, device, seed).args
    return Call((*a.args, g, w), dict(a.kwargs), weights_arg=len(a.args) + 1)


def _bytes(wl):
    # the members' bytes less the attention output's trip through memory (written by one, read by the other)
    trip = 2 * DTYPE_BYTES[wl.dtype] * wl.tokens * wl.config.q_width
    return spec("attention").bytes(wl) + spec("attn_out").bytes(wl) - trip


declare(PointSpec(
    "attention_out", _inputs, bytes=_bytes,
    flops=lambda wl: spec("attention").flops(wl) + spec("attn_out").flops(wl),
    tolerance={"fp32": 1e-5, "fp16": 1e-3, "bf16": 8e-3},  # attn_out's: its GEMM rounds last
    quantized=attn_out_point.QUANTIZED,
))
