"""`dense_mlp`: the SwiGLU MLP of the first dense layers.

Contract: `dense_mlp(x, w) -> y`; x [N, hidden]; w {"gate_proj", "up_proj": [ff, hidden],
"down_proj": [hidden, ff]}; y = down(silu(gate x) * up x), activation in FP32 rounded once.
"""

from beam_model.functional import swiglu
from workbench.points import Call, PointSpec, declare
from workbench.registry import register
from workbench.variants.inputs import DTYPE_BYTES, Rand, weight_bytes

QUANTIZED = {"fp8": ("gate_proj", "up_proj", "down_proj")}


@register("dense_mlp", "torch", "torch")
def dense_mlp(x, w):
    return swiglu(x, w["gate_proj"], w["up_proj"], w["down_proj"])


# ---- spec: inputs, roofline and tolerance for the harness ------------------------------------------


def _inputs(wl, device, seed):
    c, r = wl.config, Rand("dense_mlp", wl, device, seed)
    h, f = c.hidden_size, c.intermediate_size
    w = {"gate_proj": r.linear(f, h), "up_proj": r.linear(f, h), "down_proj": r.linear(h, f)}
    return Call((r.normal(wl.tokens, h), w), weights_arg=1)


declare(PointSpec(
    "dense_mlp", _inputs,
    bytes=lambda wl: DTYPE_BYTES[wl.dtype] * 2 * wl.tokens * wl.config.hidden_size
    + 3 * weight_bytes(wl, QUANTIZED, wl.config.intermediate_size, wl.config.hidden_size),
    flops=lambda wl: 6 * wl.tokens * wl.config.hidden_size * wl.config.intermediate_size,
    # BF16 capped at 1e-2: 1.6x the reference's worst vs FP64 (two roundings in the SwiGLU chain)
    tolerance={"fp32": 1e-5, "fp16": 1.5e-3, "bf16": 1e-2},
    # per-token E4M3 activations (its fp8_scaled_mm): 2x the worst norm-wise error measured on FP8 weights,
    # random and beam-mini's on text (runs/fp8-activation-error-cpu/errors.json)
    activation_tolerance={"fp8": 0.11},
    quantized=QUANTIZED,
))

