"""`qkvg_proj`: the attention sub-layer's input projections.

Contract: `qkvg_proj(x, w) -> (q, k, v, g)`; x [N, hidden]; w {"q_proj", "k_proj", "v_proj",
"gate_proj"} as [out, in] matrices; q and g [N, heads*head_dim], k and v [N, kv_heads*head_dim],
all in the model dtype (GEMMs accumulate in FP32, round once).
"""

from beam_model.functional import linear
from workbench.points import Call, PointSpec, declare
from workbench.registry import register
from workbench.variants.inputs import DTYPE_BYTES, Rand, weight_bytes

QUANTIZED = {"fp8": ("q_proj", "k_proj", "v_proj", "gate_proj")}


@register("qkvg_proj", "torch", "torch")
def qkvg_proj(x, w):
    return linear(x, w["q_proj"]), linear(x, w["k_proj"]), linear(x, w["v_proj"]), linear(x, w["gate_proj"])


# ---- spec: inputs, roofline and tolerance for the harness ------------------------------------------


def _inputs(wl, device, seed):
    c, r = wl.config, Rand("qkvg_proj", wl, device, seed)
    h = c.hidden_size
    w = {"q_proj": r.linear(c.q_width, h), "k_proj": r.linear(c.kv_width, h), "v_proj": r.linear(c.kv_width, h),
         "gate_proj": r.linear(c.q_width, h)}
    return Call((r.normal(wl.tokens, h), w), weights_arg=1)


def _out_width(c):
    return 2 * c.q_width + 2 * c.kv_width


declare(PointSpec(
    "qkvg_proj", _inputs,
    bytes=lambda wl: DTYPE_BYTES[wl.dtype] * wl.tokens * (wl.config.hidden_size + _out_width(wl.config))
    + weight_bytes(wl, QUANTIZED, _out_width(wl.config), wl.config.hidden_size),
    flops=lambda wl: 2 * wl.tokens * wl.config.hidden_size * _out_width(wl.config),
    tolerance={"fp32": 1e-5, "fp16": 8e-4, "bf16": 6e-3},  # ~2.5x the reference's worst vs FP64
    # per-token E4M3 activations (its fp8_scaled_mm): 2x the worst norm-wise error measured on FP8 weights,
    # random and beam-mini's on text (runs/fp8-activation-error-cpu/errors.json)
    activation_tolerance={"fp8": 0.09},
    quantized=QUANTIZED,
))
