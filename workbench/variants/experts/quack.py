"""`experts:quack`: the routed pairs sorted by expert and run through quack's SM90 CuTe-DSL GEMMs
(Tri Dao's `quack-kernels`: warp-specialised, TMA-fed, persistent) as variable-length groups, one
group per expert (`cu_seqlens_m`), with experts:grouped_mm's SwiGLU and combine kernels around them.

Gate and up are two GEMMs that each read every pair's input row through its token index (`A_idx`:
quack's gather of A, cp.async row loads) instead of a gathered copy; so the weights stay as the model
holds them, gate and up apart. quack's fused gated GEMM (and FlashInfer's GEMM1) wants one [gate; up]
weight: a TP8 rank has no room for a copy beside the model's, and a per-call repack is slower
(runs/bench-experts-prefill-tp8/README.md, session 14); experts:quack_gated re-lays gate and up in
place. Down is a third grouped GEMM over the activations, already in expert order.

The rounding is the reference's: gate, up and each pair's down projection in the model dtype, the
activation FP32 rounded once, the combine FP32 rounded once (experts:grouped_mm's, kernel for kernel).
Grouping is on the device (`sort_pairs`: argsort, searchsorted: no host sync).

Prefill sizes only (>= MIN_TOKENS tokens): an expert's rows are padded to whole M tiles inside the
kernel, mostly padding at decode, where experts:triton_rows reads only the selected rows. Needs the
`quack` package (and the CUTLASS DSL it is written in) and a Hopper GPU.
"""

import functools
import importlib.util

import torch

from workbench.registry import register

MIN_TOKENS = 1024

# A config: each GEMM's M x N tile, pingpong (two consumer warpgroups on alternate tiles) or
# cooperative, and the CTA cluster along M (CTAs of one cluster share the weight tile by multicast;
# gather_A needs cluster_n 1). gate/up have N = ff (320 on a TP8 rank: two 160-wide tiles fit it
# exactly), down N = hidden. From the H200 bench of session 20 (runs/bench-experts-prefill-tp8/README.md):
# gate/up fastest at 128 x 160 pingpong in 2-CTA clusters, down at 128 x 256 cooperative without one.
CONFIGS = [
    dict(gu_m=128, gu_n=160, gu_pingpong=True, gu_cluster_m=2, down_m=128, down_n=256, down_pingpong=False,
         down_cluster_m=1),
    dict(gu_m=128, gu_n=192, gu_pingpong=True, gu_cluster_m=2, down_m=128, down_n=256, down_pingpong=False,
         down_cluster_m=1),
    dict(gu_m=128, gu_n=192, gu_pingpong=True, gu_cluster_m=2, down_m=128, down_n=192, down_pingpong=True,
         down_cluster_m=2),
]


def _quack_installed() -> bool:
    return importlib.util.find_spec("quack") is not None


def _supports(wl):
    c = wl.config
    if not _quack_installed():
        return "experts:quack needs the 'quack' package (quack-kernels), which is not installed"
    if wl.dtype not in ("bf16", "fp16"):
        return f"quack's GEMMs take bf16 or fp16 here, not {wl.dtype}"
    if c.moe_intermediate_size % 8 or c.hidden_size % 8:
        return (f"ff {c.moe_intermediate_size} and hidden {c.hidden_size} must be multiples of 8 "
                "(16-byte rows for TMA)")
    if wl.tokens < MIN_TOKENS:
        return f"{wl.tokens} tokens: the grouped GEMMs are for prefill sizes (>= {MIN_TOKENS} tokens)"
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9:
        major, minor = torch.cuda.get_device_capability()
        return f"experts:quack's configs are SM90 (Hopper) ones, not for sm_{major}{minor}"
    return True


@functools.cache
def _gemm_config(m, n, pingpong, cluster_m, dynamic=False):
    """quack's config of one GEMM: the tile, pingpong, the CTA cluster along M, and (`dynamic`) its dynamic
    persistent scheduler (CTAs take tiles from an atomic counter rather than in a fixed stride)."""
    from quack.gemm_config import GemmConfig

    return GemmConfig(tile_m=m, tile_n=n, pingpong=pingpong, cluster_m=cluster_m, cluster_n=1,
                      is_dynamic_persistent=dynamic, device_capacity=9)


def grouped_gemm(a, w, cu_seqlens, config, a_idx=None):
    """out[r] = a[a_idx[r] if a_idx else r] @ w[e].T for the rows r of group e ([cu_seqlens[e],
    cu_seqlens[e + 1])), FP32 accumulation rounded to a's dtype. w is [groups, out, in], as the model
    holds a weight; quack takes B as [groups, K, N], which w's transpose is, without a copy."""
    from quack.gemm_interface import gemm_tuned

    rows = a.shape[0] if a_idx is None else a_idx.shape[0]
    out = torch.empty((rows, w.shape[1]), dtype=a.dtype, device=a.device)
    gemm_tuned.fn(a, w.transpose(1, 2), out, cu_seqlens_m=cu_seqlens, A_idx=a_idx, config=_gemm_config(*config))
    return out


def expert_bounds(sorted_ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[n_experts + 1] int32: expert e's pairs are rows [bounds[e], bounds[e + 1]) of the sorted pairs."""
    experts = torch.arange(n_experts + 1, device=sorted_ids.device, dtype=sorted_ids.dtype)
    return torch.searchsorted(sorted_ids, experts, out_int32=True)


def sort_pairs(ids: torch.Tensor, n_experts: int):
    """The routed pairs (pair = token * top_k + k) in expert order, stably (an expert's pairs keep pair
    order), on the device with no host sync. Returns cu_seqlens [n_experts + 1] int32 (expert e's pairs
    are sorted rows [cu_seqlens[e], cu_seqlens[e + 1])), tokens [pairs] int32 (each sorted row's token:
    the GEMMs' A_idx) and pos [pairs] int64 (the sorted row each pair went to: the combine's).
    The sort key is the narrowest integer type that holds every expert id: torch's CUDA radix sort makes
    a pass per key byte, eight for the int64 ids that route returns, one for uint8."""
    flat = ids.flatten()
    key = flat.to(torch.uint8 if n_experts <= 256 else torch.int16 if n_experts <= 2 ** 15 else torch.int32)
    order = key.argsort(stable=True)
    cu_seqlens = expert_bounds(flat[order], n_experts)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=order.device)
    return cu_seqlens, (order // ids.shape[1]).to(torch.int32), pos


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


@register("experts", "quack", "cute", supports=_supports, configs=CONFIGS,
          configure=lambda cfg: functools.partial(_experts_at, **cfg))
def experts_quack(x, ids, weights, w):
    """CONFIGS[0]."""
    return _experts_at(x, ids, weights, w, **CONFIGS[0])
