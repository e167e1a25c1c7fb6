"""`experts:grouped_mm`: the routed pairs sorted by expert and run through torch's grouped GEMM
(`torch._grouped_mm`: CUTLASS kernels on Hopper, what torchtitan's MoE uses) for gate, up and down,
with the SwiGLU and the weighted FP32 combine as two small Triton kernels (`kernels/moe_grouped_mm.py`).

The rounding is the reference's: gate, up and each pair's down projection in the model dtype, the
activation FP32 rounded once, the combine FP32 rounded once. Grouping is on the device (argsort,
searchsorted: no host sync). It gathers each pair's input row once ([pairs, hidden]), which the
fused experts:triton does not, so it is only timed where pairs are grouped (prefill): at decode the
GEMV path reads only the selected experts and wins by far.
"""

import torch

from workbench.registry import register


def _supports(wl):
    from workbench.variants.kernels.moe import GEMV_MAX_PAIRS  # kernels: imported on use

    if not hasattr(torch, "_grouped_mm"):
        return f"experts:grouped_mm needs torch._grouped_mm (torch >= 2.8), not torch {torch.__version__}"
    if wl.dtype not in ("bf16", "fp16", "fp32"):
        return f"experts:grouped_mm takes bf16, fp16 or fp32 weights, not {wl.dtype}"
    if wl.tokens * wl.config.num_experts_per_tok <= GEMV_MAX_PAIRS:
        return f"at most {GEMV_MAX_PAIRS} routed pairs run experts:triton's GEMV path: time that variant"
    return True


@register("experts", "grouped_mm", "triton", supports=_supports)
def experts_grouped_mm(x, ids, weights, w):
    from workbench.variants.kernels.moe_grouped_mm import combine_sorted, swiglu

    n, top_k = ids.shape
    if n == 0:
        return torch.empty_like(x)
    flat = ids.flatten()
    order = flat.argsort(stable=True)  # pair indices sorted by expert
    # each expert's end row among the sorted pairs (bincount would sync on the host for its length)
    experts = torch.arange(1, w["gate_proj"].shape[0] + 1, device=ids.device, dtype=flat.dtype)
    offs = torch.searchsorted(flat[order], experts, out_int32=True)
    rows = x.index_select(0, order // top_k)
    # weights are [E, out, in]: their transpose is the column-major [E, in, out] operand grouped_mm takes
    g = torch._grouped_mm(rows, w["gate_proj"].transpose(1, 2), offs=offs)
    u = torch._grouped_mm(rows, w["up_proj"].transpose(1, 2), offs=offs)
    del rows
    down = torch._grouped_mm(swiglu(g, u), w["down_proj"].transpose(1, 2), offs=offs)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=order.device)
    return combine_sorted(down, pos, weights.contiguous().float(), top_k)
