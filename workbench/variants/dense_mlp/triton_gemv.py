"""`dense_mlp:triton_gemv`: two Triton GEMVs (`kernels/gemv.py`): gate/up over the packed weight with
SwiGLU in the epilogue (g and u stay FP32, one rounding of silu(g) * u, so it is at least as exact as
the reference), then down.

Gate and up are packed into one weight at load time (`kernels/swiglu_mlp.py`); the model's own
weights are never changed. Split-K is deterministic (docs/decisions.md #6).
"""

import functools

from workbench.registry import register
from workbench.variants.kernels.swiglu_mlp import pack_gate_up, supports_triton
from workbench.variants.kernels.triton_common import gemv_config as _cfg

try:  # the variant is registered either way; the registry reports a missing triton
    from workbench.variants.kernels import gemv
except ImportError:
    gemv = None

# One config drives both GEMVs (TP8: gate/up 5120 -> 2x2560 rows, down 2560 -> 5120 rows). FMA for
# M = 1-4, tl.dot with M padded to 16 for M = 8-16, tiled tl.dot for M = 64 and prefill.
CONFIGS = [
    _cfg(8, 512), _cfg(8, 1024, warps=8), _cfg(4, 1024), _cfg(16, 512, split_k=2, warps=8),
    _cfg(8, 256, split_k=2), _cfg(16, 512, split_k=5, warps=8),
    _cfg(16, 256, split_k=2, stages=4, dot=True), _cfg(32, 128, split_k=2, stages=4, dot=True),
    _cfg(32, 128, split_k=2, stages=3, bm=64, dot=True), _cfg(64, 64, split_k=4, stages=4, bm=64, dot=True),
    _cfg(128, 64, warps=8, stages=3, bm=128, dot=True),
]


@register("dense_mlp", "triton_gemv", "triton", prepare=pack_gate_up, supports=supports_triton,
          configs=CONFIGS, pdl=True, configure=lambda cfg: functools.partial(dense_mlp_gemv, cfg=cfg))
def dense_mlp_gemv(x, w, cfg=CONFIGS[0]):
    """Two Triton GEMVs: gate/up with SwiGLU in the epilogue (g and u stay FP32, one rounding of
    silu(g)*u, so it is at least as exact as the reference), then down."""
    return gemv.linear(gemv.linear(x, w["gate_up"], cfg, w["locks"], swiglu=True), w["down"], cfg, w["locks"])
