"""Triton kernels of `attention:triton_widemerge` and `attention_out:triton_widemerge`:
attention:triton_prefetch's decode kernel (imported unchanged, `kernels/attention_prefetch.py`), then a
merge (for attention_out: a merge-gate) that reads each head's split partials in one round trip, over
more programs.

Why: attention:triton's merge (`merge_head`) first loads the splits' maxima, and only after that
their sums and accumulators, so a merge program waits on memory twice; its programs cover 32 of
head_dim's columns, so at batch 1 a 32K-token full-attention decode (256 splits, 6 heads a TP8 rank)
merges in 24 programs of 32 KB each. Here every program loads its splits' maxima, sums and
accumulator columns at once (`attention.merge_one_tile`: all splits in one tile, at most
MAX_MERGE_SPLITS) and covers MERGE_BLOCK_D columns, so the same merge takes 16 programs a head of 8 KB
each at MERGE_BLOCK_D 8. The arithmetic is `merge_head`'s (FP32, the largest split maximum as
the offset, empty splits weighted 0), in a different summation order over the splits: not bitwise
attention:triton's.
"""

import torch
import triton
import triton.language as tl

from workbench.variants.kernels import attention_prefetch as prefetch
from workbench.variants.kernels.attention import merge_one_tile
from workbench.variants.kernels.attention_gated_merge import gate_store
from workbench.variants.kernels.triton_common import pdl_enter, pdl_launch, round_to

MAX_MERGE_SPLITS = 1024  # splits one merge tile holds: [1024, 8] FP32 is 64 registers a thread at 4 warps


@triton.jit
def _merge_once_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, stride_on, stride_oh, n_heads, head_dim, n_splits,
                       BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """One (sequence, query head, BLOCK_D of head_dim): `merge_one_tile`, rounded once."""
    pdl_enter(PDL)
    pid = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    o = merge_one_tile(m_ptr, l_ptr, acc_ptr, pid * n_splits, n_splits, head_dim, d, d_ok, BLOCK_S)
    out = out_ptr + (pid // n_heads) * stride_on + (pid % n_heads) * stride_oh + d
    tl.store(out, round_to(o, out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _merge_gate_once_kernel(m_ptr, l_ptr, acc_ptr, g_ptr, bias_ptr, out_ptr, g_stride, n_heads, head_dim, n_splits,
                            BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """attention_out:triton's merge-gate (`attention_gated_merge._merge_gate_kernel`) with `merge_one_tile`."""
    pdl_enter(PDL)
    pid = tl.program_id(0).to(tl.int64)
    token, head = pid // n_heads, pid % n_heads
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    o = merge_one_tile(m_ptr, l_ptr, acc_ptr, pid * n_splits, n_splits, head_dim, d, d_ok, BLOCK_S)
    gate_store(o, g_ptr, bias_ptr, out_ptr, g_stride, token, head, n_heads, head_dim, d, d_ok)


def _merge_grid(splits: int, rows: int, hd: int, config: dict):
    if splits > MAX_MERGE_SPLITS:
        raise ValueError(f"triton_widemerge merges at most {MAX_MERGE_SPLITS} splits in one tile, "
                         f"config {config} makes {splits}")
    block_d = min(config["MERGE_BLOCK_D"], triton.next_power_of_2(hd))
    return (rows, triton.cdiv(hd, block_d)), dict(BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d,
                                                  num_warps=4, **pdl_launch(config.get("pdl")))


def _merge(m, l_part, acc, out, splits: int, config: dict) -> None:
    n, heads, hd = out.shape
    grid, launch = _merge_grid(splits, n * heads, hd, config)
    _merge_once_kernel[grid](m, l_part, acc, out, out.stride(0), out.stride(1), heads, hd, splits, **launch)


def _merge_gate(m, l_part, acc, g, bias, gated, splits: int, config: dict) -> None:
    n, heads, hd = acc.shape[0], acc.shape[1], acc.shape[3]
    grid, launch = _merge_grid(splits, n * heads, hd, config)
    _merge_gate_once_kernel[grid](m, l_part, acc, g, bias, gated, g.stride(0), heads, hd, splits, **launch)


def paged_attention(q, cache, meta, *, window, scale, config: dict):
    """The `attention` contract: attention:triton_prefetch's with the merge above. `config`: a full
    attention:triton_prefetch config plus MERGE_BLOCK_D (head_dim columns a merge program)."""
    return prefetch.paged_attention(q, cache, meta, window=window, scale=scale, config=config, merge=_merge)


def decode_gated(q, cache, meta, g, bias, *, window, scale, cfg: dict) -> torch.Tensor:
    """`attention_prefetch.decode_gated` with the merge-gate above. `cfg`: a full
    attention:triton_widemerge config."""
    return prefetch.decode_gated(q, cache, meta, g, bias, window=window, scale=scale, cfg=cfg, merge=_merge_gate)
