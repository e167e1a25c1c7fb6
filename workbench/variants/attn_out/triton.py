"""`attn_out:triton`: the output gate as one Triton kernel (one pass over o and g, rounded once), then
o_proj with F.linear (cuBLAS). Kernel and configs: `kernels/output_gate.py`."""

import functools

from workbench.registry import register
from workbench.variants.kernels.output_gate import GATE_CONFIGS, gated_linear, supports


@register("attn_out", "triton", "triton", supports=supports, configs=GATE_CONFIGS,
          pdl=True, configure=lambda cfg: functools.partial(gated_linear, **cfg))
def attn_out_triton(o, g, w):
    """Triton gate kernel (one pass, rounded once), then o_proj with F.linear."""
    return gated_linear(o, g, w, **GATE_CONFIGS[0])
