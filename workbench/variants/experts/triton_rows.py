"""`experts:triton_rows`: experts:triton's decode GEMV with each program's weight rows loaded whole
in one step (`kernels/moe_rows.py` says why). Up to `GEMV_MAX_PAIRS` routed pairs; more (a prompt
through a decode lock) take experts:triton's own choice by size (`kernels/moe_decode.py`), so the
search times this variant only at decode.

Never run a config whose tile would spill registers on sm_90 (`_config_supports`, docs/decisions.md #26).
"""

from workbench.registry import register
from workbench.variants.kernels.moe_decode import decode_supports, gemv_or_grouped

# BLOCK_N whole gate/up rows per program at num_warps, DOWN_BLOCK_N hidden rows (of all top_k experts)
# per down program at DOWN_WARPS; STEPS / DOWN_STEPS such blocks per program, double-buffered (default
# 1). With BLOCK_K, gate/up is experts:triton's looped kernel at the decode lock's tile (8 x 512, 2
# warps), so only the down kernel is new. None spills on sm_90 (`moe_rows.MAX_ELEMENTS_PER_THREAD`).
CONFIGS = [
    dict(BLOCK_N=1, num_warps=8, DOWN_BLOCK_N=2, DOWN_WARPS=4, DOWN_STEPS=4),
    dict(BLOCK_N=1, num_warps=8, DOWN_BLOCK_N=4, DOWN_WARPS=8, DOWN_STEPS=4),
    dict(BLOCK_N=1, num_warps=8, STEPS=4, DOWN_BLOCK_N=4, DOWN_WARPS=4),
    dict(BLOCK_N=1, num_warps=8, DOWN_BLOCK_N=4, DOWN_WARPS=4),
    dict(BLOCK_N=1, num_warps=8, DOWN_BLOCK_N=8, DOWN_WARPS=8),
    dict(BLOCK_N=1, num_warps=4, DOWN_BLOCK_N=2, DOWN_WARPS=2),
    dict(BLOCK_N=8, BLOCK_K=512, num_warps=2, DOWN_BLOCK_N=4, DOWN_WARPS=4),
]


def _config_supports(config, wl):
    from workbench.variants.kernels.moe_rows import MAX_ELEMENTS_PER_THREAD, elements_per_thread

    c = wl.config
    per_thread = elements_per_thread(config, c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok)
    if per_thread > MAX_ELEMENTS_PER_THREAD:
        return f"{per_thread} weight elements a thread at hidden {c.hidden_size}, ff {c.moe_intermediate_size} " \
               f"(more than {MAX_ELEMENTS_PER_THREAD}: the tile would spill registers)"
    return True


def _at(config=None):
    config = config or CONFIGS[0]

    def experts_triton_rows(x, ids, weights, w):
        from workbench.variants.kernels.moe_rows import fused_experts_rows  # kernels: imported on use

        return gemv_or_grouped(x, ids, weights, w, config, fused_experts_rows)
    return experts_triton_rows


register("experts", "triton_rows", "triton", supports=decode_supports("triton_rows"), configs=CONFIGS,
         configure=_at, config_supports=_config_supports, pdl=True)(_at())
