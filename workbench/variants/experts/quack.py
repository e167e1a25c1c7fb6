"""`experts:quack`: the routed pairs sorted by expert and run through quack's SM90 CuTe-DSL GEMMs
(Tri Dao's `quack-kernels`: warp-specialised, TMA-fed, persistent) as variable-length groups, one
group per expert (`cu_seqlens_m`), with experts:grouped_mm's SwiGLU and combine kernels around them
(`kernels/quack_moe.py`, `kernels/moe_grouped_mm.py`).

Gate and up are two GEMMs that each read every pair's input row through its token index (`A_idx`:
quack's gather of A, cp.async row loads) instead of a gathered copy; so the weights stay as the model
holds them, gate and up apart. quack's fused gated GEMM (and FlashInfer's GEMM1) wants one [gate; up]
weight: a TP8 rank has no room for a copy beside the model's, and a per-call repack costs more than
it saves (docs/decisions.md #24); experts:quack_gated re-lays gate and up in place. Down is a third
grouped GEMM over the activations, already in expert order.

The rounding is the reference's: gate, up and each pair's down projection in the model dtype, the
activation FP32 rounded once, the combine FP32 rounded once (experts:grouped_mm's, kernel for kernel).
Grouping is on the device (`sort_pairs`: argsort, searchsorted: no host sync).

Prefill sizes only (>= `quack_moe.MIN_TOKENS` tokens). Needs the `quack` package (and the CUTLASS DSL
it is written in) and a Hopper GPU.
"""

import functools

import torch

from workbench.registry import register
from workbench.variants.kernels.quack_moe import grouped_gemm, quack_limits, sort_pairs

# A config: each GEMM's M x N tile, pingpong (two consumer warpgroups on alternate tiles) or
# cooperative, and the CTA cluster along M (CTAs of one cluster share the weight tile by multicast;
# gather_A needs cluster_n 1). gate/up have N = ff (320 on a TP8 rank: two 160-wide tiles fit it
# exactly), down N = hidden. First the H200's fastest: gate/up at 128 x 160 pingpong in 2-CTA
# clusters, down at 128 x 256 cooperative without one.
CONFIGS = [
    dict(gu_m=128, gu_n=160, gu_pingpong=True, gu_cluster_m=2, down_m=128, down_n=256, down_pingpong=False,
         down_cluster_m=1),
    dict(gu_m=128, gu_n=192, gu_pingpong=True, gu_cluster_m=2, down_m=128, down_n=256, down_pingpong=False,
         down_cluster_m=1),
    dict(gu_m=128, gu_n=192, gu_pingpong=True, gu_cluster_m=2, down_m=128, down_n=192, down_pingpong=True,
         down_cluster_m=2),
]


def _experts_at(x, ids, weights, w, *, gu_m, gu_n, gu_pingpong, gu_cluster_m, down_m, down_n, down_pingpong,
                down_cluster_m):
    from workbench.variants.kernels.moe_grouped_mm import combine_sorted, swiglu

    n, top_k = ids.shape
    if n == 0:
        return torch.empty_like(x)
    x = x.contiguous()
    cu_seqlens, tokens, pos = sort_pairs(ids, w["gate_proj"].shape[0])
    gate_up = (gu_m, gu_n, gu_pingpong, gu_cluster_m)
    act = swiglu(grouped_gemm(x, w["gate_proj"], cu_seqlens, gate_up, tokens),
                 grouped_gemm(x, w["up_proj"], cu_seqlens, gate_up, tokens))
    down = grouped_gemm(act, w["down_proj"], cu_seqlens, (down_m, down_n, down_pingpong, down_cluster_m))
    return combine_sorted(down, pos, weights.contiguous().float(), top_k)


@register("experts", "quack", "cute", supports=quack_limits, configs=CONFIGS,
          configure=lambda cfg: functools.partial(_experts_at, **cfg))
def experts_quack(x, ids, weights, w):
    """CONFIGS[0]."""
    return _experts_at(x, ids, weights, w, **CONFIGS[0])
