"""`experts:flashinfer_down`: experts:triton_rounded's grouped path with its down GEMM replaced by
FlashInfer's SM90 CuTe-DSL GEMM2 (experts:flashinfer's second kernel).

Why a hybrid: FlashInfer's GEMM1 wants gate and up interleaved in one tensor, which the model does not
hold (a per-call repack costs more than it saves), but its GEMM2 takes the down weight as the model
holds it and is faster than `down_grouped_kernel` at prefill (docs/variants.md, `experts`). So: Triton
groups the pairs by expert (`align_by_expert`, each expert's rows padded to whole tiles) and runs
gate/up + SwiGLU into those rows (`grouped_gate_up`); the same grouping, read as FlashInfer's routing
maps, drives GEMM2, which writes each pair's down projection rounded to the model dtype;
experts:triton's combine weights and sums them in FP32, rounded once. The rounding is
experts:triton_rounded's, kernel for kernel.

Prefill sizes only (>= MIN_TOKENS tokens; the grouped path's tiles of 64 or 128 rows per expert are
mostly padding at decode, where experts:triton_rows reads only the selected rows).
"""

import functools

import torch

from workbench.registry import register
from workbench.variants.kernels.flashinfer_moe import Routing, cluster_supports, cute_moe_limits, down_rows

MIN_TOKENS = 1024

# The gate/up tile is the 8 x 2K prefill lock's (BLOCK_M = the CuTe M tile); GEMM2's N tile and cluster
# are the three fastest on the H200 at 8 x 2K.
_GATE_UP = dict(tile=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3)
CONFIGS = [
    dict(_GATE_UP, gemm2_n=256, cluster_n=1),
    dict(_GATE_UP, gemm2_n=128, cluster_n=2),
    dict(_GATE_UP, gemm2_n=128, cluster_n=1),
]


def _supports(wl):
    limits = cute_moe_limits(wl, 8)
    if limits is not True:
        return limits
    if wl.tokens < MIN_TOKENS:
        return f"{wl.tokens} tokens: the grouped path is for prefill sizes (>= {MIN_TOKENS} tokens)"
    return True


def routing_of(sorted_pairs: torch.Tensor, block_expert: torch.Tensor, n_pairs: int, n_experts: int,
               tile: int) -> Routing:
    """`align_by_expert`'s grouping as FlashInfer's routing maps: padding rows (sentinel n_pairs) become
    -1, a tile's row limit is where its padding starts (padding only ends an expert's run), and the
    tiles in use are those with an expert (the worst-case surplus is marked n_experts)."""
    valid = sorted_pairs < n_pairs
    n_tiles = block_expert.numel()
    limit = valid.view(n_tiles, tile).sum(1) + torch.arange(n_tiles, device=valid.device) * tile
    return Routing(block_expert, limit.to(torch.int32), torch.where(valid, sorted_pairs, -1),
                   (block_expert < n_experts).sum().to(torch.int32).view(1))


def _experts_at(x, ids, weights, w, *, tile, BLOCK_N, BLOCK_K, num_warps, num_stages, gemm2_n, cluster_n):
    from workbench.variants.kernels.moe import checked_weights, combine, grouped_gate_up

    wg, wu, _ = checked_weights(w, "experts:flashinfer_down", down=False)  # FlashInfer reads down as it is
    n, top_k = ids.shape
    n_experts = wg.shape[0]
    n_pairs = n * top_k
    if n_pairs == 0:
        return torch.empty_like(x)
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous().float()
    sorted_pairs, block_expert, act = grouped_gate_up(x, ids, wg, wu, block_m=tile, block_n=BLOCK_N, block_k=BLOCK_K,
                                                      num_warps=num_warps, num_stages=num_stages)
    r = routing_of(sorted_pairs, block_expert, n_pairs, n_experts, tile)
    rows = down_rows(act, w["down_proj"], r, weights, top_k, tile=tile, gemm2_n=gemm2_n, cluster_n=cluster_n)
    return combine(rows, weights, top_k, weighted=True, dtype=x.dtype)


@register("experts", "flashinfer_down", "flashinfer", supports=_supports, configs=CONFIGS,
          config_supports=cluster_supports, configure=lambda cfg: functools.partial(_experts_at, **cfg))
def experts_flashinfer_down(x, ids, weights, w):
    """CONFIGS[0]."""
    return _experts_at(x, ids, weights, w, **CONFIGS[0])
