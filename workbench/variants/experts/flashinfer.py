"""`experts:flashinfer`: the two CuTe-DSL grouped GEMMs of FlashInfer's SM90 fused MoE
(`cute_dsl_fused_moe_bf16`'s GEMM1 and GEMM2), with the routing maps and the combine of our own.

GEMM1 gathers each routed pair's input row and runs the grouped warp-specialised TMA GEMM with the
SwiGLU in its epilogue; GEMM2 is the grouped down projection, each pair's unscaled row scattered to
its (token, slot) place (the deterministic mode: the fused finalize accumulates in the model dtype
with atomics, which the op gate's same-input-twice check rejects). FlashInfer's own `moe_sort` and
`moe_unpermute` are not used: their JIT module builds from trtllm-gen headers it downloads from
NVIDIA's artifactory on first use, which an offline GPU host cannot reach. Here `sort_by_expert`
makes the same maps with torch on the device (no host sync) and experts:triton's combine kernel does
the weighted FP32 sum in slot order, rounded once (the reference's combine).

Rounding against the reference: each pair's down projection is rounded to the model dtype and the
combine is FP32 rounded once, as there; the SwiGLU takes gate and up from the FP32 accumulators
rather than rounded to the model dtype first (so does experts:triton's grouped path).

GEMM1 takes gate and up as one [experts, 2 x ff, hidden] weight, up and gate interleaved in blocks of
32 rows. The model holds them apart and a packed copy of every MoE layer would not fit beside a TP8
rank's weights, so each call repacks the layer's gate and up into one scratch buffer. That moves all
experts' gate/up weights per call, which only a prefill's GEMMs amortise: calls under MIN_TOKENS
tokens are declined (experts:triton / triton_rows serve decode).

Backend `flashinfer` plus the CUTLASS DSL package (`cutlass`), an SM90 GPU (the kernels are Hopper
only), BF16/FP16 weights, ff a multiple of 32 and hidden of 8 (the kernels' constraints).
"""

import functools

import torch

from workbench.registry import register
from workbench.variants.kernels.flashinfer_moe import Routing, cluster_supports, cute_moe_limits, down_rows

MIN_TOKENS = 1024
INTERLEAVE = 32  # GEMM1's epilogue pairs up row block j with the gate row block after it

# A config: the M tile (rows of one expert per tile), GEMM1's N tile and persistent-walk swizzle
# (M tiles per pass over an expert's weights), GEMM2's N tile and CTA cluster along N ((1, 2) multicasts
# the intermediate). The first is FlashInfer's default tactic; each costs two CuTe DSL compiles.
CONFIGS = [
    dict(tile=128, gemm1_n=64, swizzle=1, gemm2_n=64, cluster_n=1),
    dict(tile=128, gemm1_n=128, swizzle=1, gemm2_n=128, cluster_n=1),
    dict(tile=128, gemm1_n=256, swizzle=8, gemm2_n=256, cluster_n=1),
    dict(tile=128, gemm1_n=128, swizzle=8, gemm2_n=128, cluster_n=2),
]


def max_tiles(pairs: int, num_experts: int, tile: int) -> int:
    """The most tiles any routing of `pairs` can need: (num_experts - 1) experts with one pair each."""
    return pairs if pairs <= num_experts else (pairs + (tile - 1) * num_experts) // tile


def sort_by_expert(ids: torch.Tensor, num_experts: int, tile: int) -> Routing:
    """The routing maps GEMM1 and GEMM2 read, on the device without a host sync: expert e's pairs take
    rows [start_e, start_e + count_e) (stable order), start_e a multiple of `tile`."""
    dev, flat = ids.device, ids.reshape(-1).long()
    pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    tiles = (counts + tile - 1) // tile
    tile_end = tiles.cumsum(0)
    start = (tile_end - tiles) * tile
    order = flat.argsort(stable=True)
    expert = flat[order]
    rank = torch.arange(pairs, device=dev) - (counts.cumsum(0) - counts)[expert]
    n_tiles = max_tiles(pairs, num_experts, tile)
    row_pair = torch.full((n_tiles * tile,), -1, dtype=torch.int32, device=dev)
    row_pair[start[expert] + rank] = order.to(torch.int32)
    tile_expert = torch.searchsorted(tile_end, torch.arange(n_tiles, device=dev), right=True)
    tile_expert.clamp_(max=num_experts - 1)  # tiles past the last in use
    return Routing(tile_expert.to(torch.int32), (start + counts)[tile_expert].to(torch.int32), row_pair,
                   tile_end[-1:].to(torch.int32))


def interleave_up_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[E, 2 x ff, hidden] with rows [up 0:32, gate 0:32, up 32:64, gate 32:64, ...], GEMM1's layout."""
    e, ff, h = gate.shape
    if up.shape != gate.shape or ff % INTERLEAVE:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must match, ff a multiple of "
                         f"{INTERLEAVE}")
    out = torch.empty((e, 2 * ff, h), dtype=gate.dtype, device=gate.device)
    blocks = out.view(e, ff // INTERLEAVE, 2, INTERLEAVE, h)
    blocks[:, :, 0].copy_(up.view(e, ff // INTERLEAVE, INTERLEAVE, h))
    blocks[:, :, 1].copy_(gate.view(e, ff // INTERLEAVE, INTERLEAVE, h))
    return out


def _supports(wl):
    limits = cute_moe_limits(wl, INTERLEAVE)
    if limits is not True:
        return limits
    if wl.tokens < MIN_TOKENS:
        return (f"{wl.tokens} tokens: the per-call gate/up repack only pays at prefill sizes "
                f"(>= {MIN_TOKENS} tokens)")
    return True


def _experts_at(x, ids, weights, w, *, tile, gemm1_n, swizzle, gemm2_n, cluster_n):
    from flashinfer.fused_moe.cute_dsl.sm90_contiguous_gather_grouped_gemm_act_fusion import (
        sm90_contiguous_gather_grouped_gemm_act_fusion as gemm1,
    )

    from workbench.variants.kernels.moe import combine

    n, top_k = ids.shape
    if n == 0:
        return torch.empty_like(x)
    r = sort_by_expert(ids, w["gate_proj"].shape[0], tile)
    weights = weights.float().contiguous()
    act = gemm1(x.contiguous(), interleave_up_gate(w["gate_proj"], w["up_proj"]), r.tile_expert, r.tile_row_limit,
                r.row_pair, r.num_tiles, topk=top_k, permuted_m=r.rows, tile_shape_mn=(tile, gemm1_n),
                swizzle_size=swizzle, enable_pdl=False)
    rows = down_rows(act, w["down_proj"], r, weights, top_k, tile=tile, gemm2_n=gemm2_n, cluster_n=cluster_n)
    return combine(rows, weights, top_k, weighted=True, dtype=x.dtype)


@register("experts", "flashinfer", "flashinfer", supports=_supports, configs=CONFIGS, config_supports=cluster_supports,
          configure=lambda cfg: functools.partial(_experts_at, **cfg))
def experts_flashinfer(x, ids, weights, w):
    """FlashInfer's default tactic (CONFIGS[0])."""
    return _experts_at(x, ids, weights, w, **CONFIGS[0])
