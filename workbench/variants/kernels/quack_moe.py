"""quack's SM90 CuTe-DSL grouped GEMMs (Tri Dao's `quack-kernels`) as the experts variants `quack` and
`quack_gated` call them: where they run (`quack_limits`), a GEMM's config (`gemm_config`), one grouped
GEMM over variable-length groups (`grouped_gemm`), and the routed pairs sorted into those groups
(`sort_pairs`).

Imports no quack: it is an optional backend, imported on a variant's first call (docs/decisions.md #25),
so the point imports and the variants are listed as unavailable, with the reason, where it is missing.
"""

import functools
import importlib.util

import torch

# Prefill sizes only: an expert's rows are padded to whole M tiles inside the kernel, mostly padding
# at decode, where experts:triton_rows reads only the selected rows (docs/decisions.md #27)
MIN_TOKENS = 1024


def _quack_installed() -> bool:
    return importlib.util.find_spec("quack") is not None


def quack_limits(wl):
    """True, or why quack's grouped GEMMs do not run `wl` here (package, dtype, 16-byte rows, prefill
    sizes, Hopper)."""
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
def gemm_config(m, n, pingpong, cluster_m, dynamic=False):
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
    gemm_tuned.fn(a, w.transpose(1, 2), out, cu_seqlens_m=cu_seqlens, A_idx=a_idx, config=gemm_config(*config))
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
