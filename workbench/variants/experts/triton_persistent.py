"""`experts:triton_persistent`: experts:triton_rows' decode GEMVs in one cooperative launch, gate/up and
down apart by a grid barrier (`_triton_moe_persistent.py` says why). Up to `GEMV_MAX_PAIRS` routed pairs;
more (a prompt through a decode lock) take experts:triton's own choice by size, so the search times it
only at decode. A module of its own so that the locks holding other experts variants stay valid.
"""

from workbench.registry import register
from workbench.variants.experts.triton_rows import decode_supports, gemv_or_grouped

# BLOCK_N gate/up rows and DOWN_BLOCK_N hidden rows (of all top_k experts) a unit, PER_SM programs on
# each SM. The tiles are experts:triton_rows' decode lock's (1 row at 8 warps, 2 rows). Compiled for
# sm_90 on the CPU, each fits 2 programs an SM by its registers
# (runs/sm90-resources-experts/resources-persistent.jsonl); a cooperative launch of more programs than
# fit is refused, and the gate rejects that config.
CONFIGS = [
    dict(BLOCK_N=1, DOWN_BLOCK_N=2, num_warps=8, PER_SM=2),
    dict(BLOCK_N=1, DOWN_BLOCK_N=2, num_warps=8, PER_SM=1),
    dict(BLOCK_N=1, DOWN_BLOCK_N=4, num_warps=4, PER_SM=2),
]


def _persistent():
    from workbench.variants.kernels.moe_persistent import fused_experts_persistent
    return fused_experts_persistent


def _at(config=None):
    return gemv_or_grouped(config or CONFIGS[0], _persistent)


register("experts", "triton_persistent", "triton", supports=decode_supports("triton_persistent"), configs=CONFIGS,
         configure=_at, pdl=True)(_at())
