"""What the decode-GEMV experts variants (`experts:triton_rows`, `experts:triton_persistent`,
`experts:triton_quantized`) share: the sizes they serve (up to `moe.GEMV_MAX_PAIRS` routed pairs) and,
for the BF16 ones, past them the hand-off to experts:triton's fused kernels at its own choice by size
(a prompt through a decode lock).

Imports no triton: the variant modules import it when they register, and the kernels are imported on
the first call (docs/decisions.md #27: each variant declines the sizes it does not serve, so the
search times these only at decode).
"""


def decode_supports(variant: str, past: str = "it runs experts:triton's grouped path: time that variant"):
    """The `supports` of a decode-GEMV experts variant: a float dtype, at most GEMV_MAX_PAIRS routed pairs
    (`past`: why it declines more)."""
    def supports(wl):
        from workbench.variants.kernels.moe import GEMV_MAX_PAIRS  # kernels: imported on use

        if wl.dtype not in ("bf16", "fp16", "fp32"):
            return f"experts:{variant} computes in bf16, fp16 or fp32, not {wl.dtype}"
        if wl.tokens * wl.config.num_experts_per_tok > GEMV_MAX_PAIRS:
            return f"past {GEMV_MAX_PAIRS} routed pairs {past}"
        return True
    return supports


def gemv_or_grouped(x, ids, weights, w, config: dict, kernel):
    """`kernel(x, ids, weights, w, config)` for up to GEMV_MAX_PAIRS routed pairs, experts:triton's own
    choice by size past them (with `config`'s pdl)."""
    from workbench.variants.kernels.moe import GEMV_MAX_PAIRS, fused_experts

    if ids.numel() > GEMV_MAX_PAIRS:  # static shape dispatch: graph-safe
        return fused_experts(x, ids, weights, w, {"pdl": bool(config.get("pdl"))})
    return kernel(x, ids, weights, w, config)
