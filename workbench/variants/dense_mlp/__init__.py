"""`dense_mlp`: the SwiGLU MLP of the first dense layers.

Contract: `dense_mlp(x, w) -> y`; x [N, hidden]; w {"gate_proj", "up_proj": [ff, hidden],
"down_proj": [hidden, ff]}; y = down(silu(gate x) * up x), activation in FP32 rounded once.
"""

from beam_model.functional import swiglu
from workbench.points import Call, PointSpec, declare
from workbench.registry import register
from workbench.variants.inputs import DTYPE_BYTES, Rand


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
    bytes=lambda wl: DTYPE_BYTES[wl.dtype] * (2 * wl.tokens + 3 * wl.config.intermediate_size) * wl.config.hidden_size,
    flops=lambda wl: 6 * wl.tokens * wl.config.hidden_size * wl.config.intermediate_size,
    # BF16 capped at 1e-2: 1.6x the reference's worst vs FP64 (two roundings in the SwiGLU chain)
    tolerance={"fp32": 1e-5, "fp16": 1.5e-3, "bf16": 1e-2},
))


# ---- Triton variants: gate and up packed into one weight ---------------------------------------------

import functools  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

try:  # the Triton variants are registered either way; the registry reports a missing triton
    from workbench.variants.kernels import gemv as _triton_gemv
except ImportError:
    _triton_gemv = None


def pack_gate_up(w):
    """Weight-layout transform (load time): [gate; up] as one [2*ff, hidden] matrix, so one GEMM (one
    weight stream, one read of x) makes both, and row r of gate sits ff rows before row r of up."""
    return {"gate_up": torch.cat([w["gate_proj"], w["up_proj"]]).contiguous(), "down": w["down_proj"].contiguous(),
            "locks": _triton_gemv.new_locks(w["down_proj"].device)}


def supports_triton(wl):
    if wl.dtype not in ("bf16", "fp16", "fp32"):
        return f"the Triton kernels take bf16/fp16/fp32, not {wl.dtype}"
    return True


ACT_CONFIGS = [dict(BLOCK=1024, num_warps=4), dict(BLOCK=512, num_warps=4), dict(BLOCK=2048, num_warps=8),
               dict(BLOCK=256, num_warps=2)]


@register("dense_mlp", "triton", "triton", prepare=pack_gate_up, supports=supports_triton, configs=ACT_CONFIGS,
          pdl=True, configure=lambda cfg: functools.partial(dense_mlp_triton, cfg=cfg))
def dense_mlp_triton(x, w, cfg=ACT_CONFIGS[0]):
    """Packed gate/up GEMM (torch; rounds g and u like the reference) -> one Triton silu*mul kernel
    reading [N, 2*ff] once -> down GEMM (torch)."""
    return F.linear(_triton_gemv.silu_mul(F.linear(x, w["gate_up"]), cfg), w["down"])


from workbench.variants.kernels.triton_common import gemv_config as _cfg  # noqa: E402

# One config drives both GEMVs (TP8: gate/up 5120 -> 2x2560 rows, down 2560 -> 5120 rows). FMA for
# M = 1-4, tl.dot with M padded to 16 for M = 8-16, tiled tl.dot for M = 64 and prefill.
GEMV_CONFIGS = [
    _cfg(8, 512), _cfg(8, 1024, warps=8), _cfg(4, 1024), _cfg(16, 512, split_k=2, warps=8),
    _cfg(8, 256, split_k=2), _cfg(16, 512, split_k=5, warps=8),
    _cfg(16, 256, split_k=2, stages=4, dot=True), _cfg(32, 128, split_k=2, stages=4, dot=True),
    _cfg(32, 128, split_k=2, stages=3, bm=64, dot=True), _cfg(64, 64, split_k=4, stages=4, bm=64, dot=True),
    _cfg(128, 64, warps=8, stages=3, bm=128, dot=True),
]


@register("dense_mlp", "triton_gemv", "triton", prepare=pack_gate_up, supports=supports_triton,
          configs=GEMV_CONFIGS, pdl=True, configure=lambda cfg: functools.partial(dense_mlp_gemv, cfg=cfg))
def dense_mlp_gemv(x, w, cfg=GEMV_CONFIGS[0]):
    """Two Triton GEMVs: gate/up with SwiGLU in the epilogue (g and u stay FP32, one rounding of
    silu(g)*u, so it is at least as exact as the reference), then down."""
    return _triton_gemv.linear(_triton_gemv.linear(x, w["gate_up"], cfg, w["locks"], swiglu=True), w["down"],
                               cfg, w["locks"])
