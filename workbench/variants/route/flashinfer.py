"""`route:flashinfer`: the FP32 router GEMM (cuBLAS, no TF32), then FlashInfer's fused noaux_tc selection.

`flashinfer.fused_moe.fused_topk_deepseek` documents exactly this point's selection: sigmoid(logits)
+ bias, groups scored by their top-2, top groups, top_k experts, unbiased sigmoid weights
renormalised times the scale, in FP32 whatever the input dtype. Its limits are in `supports`.

FlashInfer is imported on the first call: this module must import without it (docs/decisions.md #25).
"""

import torch

from workbench.registry import register


def _supports(wl):
    c = wl.config
    per_group = c.n_routed_experts // c.n_group
    if c.n_routed_experts % c.n_group or c.n_group > 32 or per_group > 32 or per_group * c.topk_group > 128:
        return ("fused_topk_deepseek needs equal groups, at most 32 of them, at most 32 experts per group "
                "and at most 128 experts in the kept groups")
    if c.num_experts_per_tok > 8:
        return f"fused_topk_deepseek picks at most 8 experts per token, not {c.num_experts_per_tok}"
    return True


@register("route", "flashinfer", "flashinfer", supports=_supports)
def route_flashinfer(x, w, *, n_group, topk_group, top_k, scale):
    from flashinfer.fused_moe import fused_topk_deepseek

    logits = x.float() @ w["weight"].float().t()  # FP32 as the reference (torch keeps TF32 off by default)
    n = logits.shape[0]
    weights = torch.empty(n, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(n, top_k, dtype=torch.int32, device=x.device)
    fused_topk_deepseek(logits, w["bias"].float().contiguous(), n_group, topk_group, top_k, scale, weights, ids,
                        launch_with_pdl=False)
    return ids.long(), weights
