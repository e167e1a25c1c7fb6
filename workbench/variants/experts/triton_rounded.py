"""`experts:triton_rounded`: experts:triton's grouped (prefill) path with each routed pair's output
rounded to the model dtype before the weighted FP32 combine: the reference's rounding, and half the
bytes between the down projection and the combine (`kernels/moe.py`, `rounded=True`). Decode shapes
take experts:triton's GEMV path, so the search times this variant only where pairs are grouped.

Its configs are experts:triton's grouped ones, taken from that variant's list so the two never drift
apart; a GEMV config is refused.
"""

from workbench.registry import register
from workbench.variants.experts.triton import CONFIGS as TRITON_CONFIGS

GROUPED_CONFIGS = [c for c in TRITON_CONFIGS if c["path"] == "grouped"]


def _supports(wl):
    from workbench.variants.kernels.moe import GEMV_MAX_PAIRS  # kernels: imported on use

    if wl.dtype not in ("bf16", "fp16", "fp32"):
        return f"experts:triton_rounded takes bf16, fp16 or fp32 weights, not {wl.dtype}"
    if wl.tokens * wl.config.num_experts_per_tok <= GEMV_MAX_PAIRS:
        return f"at most {GEMV_MAX_PAIRS} routed pairs run experts:triton's GEMV path: time that variant"
    return True


def _at(config=None):
    def experts_triton_rounded(x, ids, weights, w):
        from workbench.variants.kernels.moe import GEMV_MAX_PAIRS, fused_experts

        if ids.numel() <= GEMV_MAX_PAIRS:  # decode: the GEMV path keeps no per-pair rows
            return fused_experts(x, ids, weights, w, {"pdl": bool(config and config.get("pdl"))})
        if config is not None and config["path"] != "grouped":
            raise ValueError(f"experts:triton_rounded takes grouped configs, not {config}")
        return fused_experts(x, ids, weights, w, config, rounded=True)
    return experts_triton_rounded


register("experts", "triton_rounded", "triton", supports=_supports, configs=GROUPED_CONFIGS,
         configure=_at, pdl=True)(_at())
