"""`experts:triton_persistent`: experts:triton_rows' decode GEMVs in one cooperative launch, gate/up and
down apart by a grid barrier (`kernels/moe_persistent.py` says why). Up to `GEMV_MAX_PAIRS` routed
pairs; more (a prompt through a decode lock) take experts:triton's own choice by size
(`kernels/moe_decode.py`), so the search times it only at decode.

Never launch more programs than fit on the GPU at once: the grid barrier would wait forever, so the
launch is cooperative and the driver refuses a grid that cannot all be resident.
"""

from workbench.registry import register
from workbench.variants.kernels.moe_decode import decode_supports, gemv_or_grouped

# BLOCK_N gate/up rows and DOWN_BLOCK_N hidden rows (of all top_k experts) a unit, PER_SM programs on
# each SM. The tiles are experts:triton_rows' decode lock's (1 row at 8 warps, 2 rows). Compiled for
# sm_90 on the CPU (`scripts/sm90_resources.py --persistent`), each fits 2 programs an SM by its
# registers; a cooperative launch of more programs than fit is refused, and the gate rejects that config.
CONFIGS = [
    dict(BLOCK_N=1, DOWN_BLOCK_N=2, num_warps=8, PER_SM=2),
    dict(BLOCK_N=1, DOWN_BLOCK_N=2, num_warps=8, PER_SM=1),
    dict(BLOCK_N=1, DOWN_BLOCK_N=4, num_warps=4, PER_SM=2),
]


def _at(config=None):
    config = config or CONFIGS[0]

    def experts_triton_persistent(x, ids, weights, w):
        from workbench.variants.kernels.moe_persistent import fused_experts_persistent  # kernels: imported on use

        return gemv_or_grouped(x, ids, weights, w, config, fused_experts_persistent)
    return experts_triton_persistent


register("experts", "triton_persistent", "triton", supports=decode_supports("triton_persistent"), configs=CONFIGS,
         configure=_at, pdl=True)(_at())
