"""`experts:triton_persistent`: experts:triton_rows' decode GEMVs in one cooperative launch, gate/up and
down apart by a grid barrier (`_triton_moe_persistent.py` says why). Up to `GEMV_MAX_PAIRS` routed pairs;
more (a prompt through a decode lock) take experts:triton's own choice by size, so the search times it
only at decode. A module of its own so that the locks holding other experts variants stay valid.
"""

from workbench.registry import register

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


def _supports(wl):
    from workbench.variants._triton_moe import GEMV_MAX_PAIRS  # kernels: imported on use, as experts.py does

    if wl.dtype not in ("bf16", "fp16", "fp32"):
        return f"experts:triton_persistent takes bf16, fp16 or fp32 weights, not {wl.dtype}"
    if wl.tokens * wl.config.num_experts_per_tok > GEMV_MAX_PAIRS:
        return f"past {GEMV_MAX_PAIRS} routed pairs it runs experts:triton's grouped path: time that variant"
    return True


def _at(config=None):
    config = config or CONFIGS[0]

    def experts_triton_persistent(x, ids, weights, w):
        from workbench.variants._triton_moe import GEMV_MAX_PAIRS, fused_experts
        from workbench.variants._triton_moe_persistent import fused_experts_persistent

        if ids.numel() > GEMV_MAX_PAIRS:  # static shape dispatch: graph-safe
            return fused_experts(x, ids, weights, w, {"pdl": bool(config.get("pdl"))})
        return fused_experts_persistent(x, ids, weights, w, config)
    return experts_triton_persistent


register("experts", "triton_persistent", "triton", supports=_supports, configs=CONFIGS, configure=_at,
         pdl=True)(_at())
