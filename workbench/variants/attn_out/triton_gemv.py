"""`attn_out:triton_gemv`: the Triton output-gate kernel, then o_proj through the small-M Triton GEMV
(`kernels/gemv.linear`: with PDL it reads its first weight tile, here up to a whole o_proj row, before
it waits for the gate) for 1-16 rows; more rows take cuBLAS, as `attn_out:triton` does. At decode the
o_proj GEMV streams 7.9 MB a layer (TP8), a size at which cuBLAS's kernel runs well short of its bytes
floor (docs/variants.md)."""

import torch.nn.functional as F

from workbench.registry import register
from workbench.variants.kernels.output_gate import GATED_GEMV_MAX_TOKENS, output_gate, supports
from workbench.variants.kernels.triton_common import gemv_config

# o_proj rows are q_width (768 at TP8) long: a 1024-wide tile takes a whole row in one step. The 4 x 256
# tile is the fastest at decode b1 with PDL (docs/variants.md); the last three are its neighbours
CONFIGS = [gemv_config(4, 1024), gemv_config(8, 1024, warps=8), gemv_config(2, 1024, warps=2),
           gemv_config(4, 256), gemv_config(8, 256),
           gemv_config(2, 256, warps=2), gemv_config(4, 128), gemv_config(4, 512)]


def _triton_gemv_at(o, g, w, *, pdl=False, **cfg):
    gated = output_gate(o, g, w["gate_bias"], pdl=pdl)
    if not 0 < gated.shape[0] <= GATED_GEMV_MAX_TOKENS:  # static shape dispatch: graph-safe
        return F.linear(gated, w["o_proj"])
    from workbench.variants.kernels.gemv import linear  # kernels: imported on use (needs triton)

    return linear(gated, w["o_proj"].contiguous(), {**cfg, "pdl": pdl})


@register("attn_out", "triton_gemv", "triton", supports=supports, configs=CONFIGS, pdl=True,
          configure=lambda cfg: lambda o, g, w: _triton_gemv_at(o, g, w, **cfg))
def attn_out_triton_gemv(o, g, w):
    return _triton_gemv_at(o, g, w, **CONFIGS[0])
