"""`experts:triton_rows`: experts:triton's decode GEMV with each program's weight rows loaded whole
in one step (`_triton_moe_rows.py` says why). Up to `GEMV_MAX_PAIRS` routed pairs; more (a prompt
through a decode lock) take experts:triton's own choice by size, so the search times this variant
only at decode. A module of its own so that the locks holding experts:triton stay valid.
"""

from workbench.registry import register

# BLOCK_N whole gate/up rows per program at num_warps, DOWN_BLOCK_N hidden rows (of all top_k experts)
# per down program at DOWN_WARPS; STEPS / DOWN_STEPS such blocks per program, double-buffered (default
# 1). With BLOCK_K, gate/up is experts:triton's looped kernel at the decode lock's tile (8 x 512, 2
# warps), so only the down kernel is new. The H200 benches (runs/bench-experts-rows-tp8-b1/) kept
# these; none spills on sm_90 (`_triton_moe_rows.MAX_ELEMENTS_PER_THREAD`). The first won the second.
CONFIGS = [
    dict(BLOCK_N=1, num_warps=8, DOWN_BLOCK_N=2, DOWN_WARPS=4, DOWN_STEPS=4),
    dict(BLOCK_N=1, num_warps=8, DOWN_BLOCK_N=4, DOWN_WARPS=8, DOWN_STEPS=4),
    dict(BLOCK_N=1, num_warps=8, STEPS=4, DOWN_BLOCK_N=4, DOWN_WARPS=4),
    dict(BLOCK_N=1, num_warps=8, DOWN_BLOCK_N=4, DOWN_WARPS=4),
    dict(BLOCK_N=1, num_warps=8, DOWN_BLOCK_N=8, DOWN_WARPS=8),
    dict(BLOCK_N=1, num_warps=4, DOWN_BLOCK_N=2, DOWN_WARPS=2),
    dict(BLOCK_N=8, BLOCK_K=512, num_warps=2, DOWN_BLOCK_N=4, DOWN_WARPS=4),
]


def decode_supports(variant: str):
    """The `supports` of a decode-GEMV experts variant: a float dtype, at most GEMV_MAX_PAIRS routed pairs."""
    def supports(wl):
        from workbench.variants.kernels.moe import GEMV_MAX_PAIRS  # kernels: imported on use, as experts.py does

        if wl.dtype not in ("bf16", "fp16", "fp32"):
            return f"experts:{variant} takes bf16, fp16 or fp32 weights, not {wl.dtype}"
        if wl.tokens * wl.config.num_experts_per_tok > GEMV_MAX_PAIRS:
            return f"past {GEMV_MAX_PAIRS} routed pairs it runs experts:triton's grouped path: time that variant"
        return True
    return supports


def gemv_or_grouped(config: dict, kernel):
    """The variant at `config`: `kernel()` (a function the kernels' module gives on first call) for up
    to GEMV_MAX_PAIRS routed pairs, experts:triton's own choice by size past them."""
    def experts(x, ids, weights, w):
        from workbench.variants.kernels.moe import GEMV_MAX_PAIRS, fused_experts

        if ids.numel() > GEMV_MAX_PAIRS:  # static shape dispatch: graph-safe
            return fused_experts(x, ids, weights, w, {"pdl": bool(config.get("pdl"))})
        return kernel()(x, ids, weights, w, config)
    return experts


def _config_supports(config, wl):
    from workbench.variants.kernels.moe_rows import MAX_ELEMENTS_PER_THREAD, elements_per_thread

    c = wl.config
    per_thread = elements_per_thread(config, c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok)
    if per_thread > MAX_ELEMENTS_PER_THREAD:
        return f"{per_thread} weight elements a thread at hidden {c.hidden_size}, ff {c.moe_intermediate_size} " \
               f"(more than {MAX_ELEMENTS_PER_THREAD}: the tile would spill registers)"
    return True


def _rows():
    from workbench.variants.kernels.moe_rows import fused_experts_rows
    return fused_experts_rows


def _at(config=None):
    return gemv_or_grouped(config or CONFIGS[0], _rows)


register("experts", "triton_rows", "triton", supports=decode_supports("triton_rows"), configs=CONFIGS,
         configure=_at, config_supports=_config_supports, pdl=True)(_at())
