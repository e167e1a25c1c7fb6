"""`dense_mlp:triton`: the packed gate/up GEMM in torch (rounding g and u as the reference's GEMMs do),
one Triton SiLU-and-multiply kernel reading [N, 2*ff] once, then the down GEMM in torch.

Gate and up are packed into one weight at load time (`kernels/swiglu_mlp.py`); the model's own
weights are never changed.
"""

import functools

import torch.nn.functional as F

from workbench.registry import register
from workbench.variants.kernels.swiglu_mlp import pack_gate_up, supports_triton

try:  # the variant is registered either way; the registry reports a missing triton
    from workbench.variants.kernels import gemv
except ImportError:
    gemv = None

CONFIGS = [dict(BLOCK=1024, num_warps=4), dict(BLOCK=512, num_warps=4), dict(BLOCK=2048, num_warps=8),
           dict(BLOCK=256, num_warps=2)]


@register("dense_mlp", "triton", "triton", prepare=pack_gate_up, supports=supports_triton, configs=CONFIGS,
          pdl=True, configure=lambda cfg: functools.partial(dense_mlp_triton, cfg=cfg))
def dense_mlp_triton(x, w, cfg=CONFIGS[0]):
    """Packed gate/up GEMM (torch; rounds g and u like the reference) -> one Triton silu*mul kernel
    reading [N, 2*ff] once -> down GEMM (torch)."""
    return F.linear(gemv.silu_mul(F.linear(x, w["gate_up"]), cfg), w["down"])
