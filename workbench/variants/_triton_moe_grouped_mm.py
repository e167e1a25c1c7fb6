"""Triton kernels of `experts:grouped_mm` (experts__grouped_mm.py): the two element-wise steps around
torch's grouped GEMMs. Imported on the variant's first call, as `_triton_moe` is, so the point
imports without triton and TRITON_INTERPRET can be set before these kernels are defined."""

import torch
import triton
import triton.language as tl

from workbench.variants._triton_common import round_to


@triton.jit
def _swiglu(g_ptr, u_ptr, act_ptr, NUMEL, BLOCK: tl.constexpr):
    """act = silu(g) * u in FP32, rounded once to act's dtype (the reference's activation)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < NUMEL
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(act_ptr + offs, round_to(g / (1.0 + tl.exp(-g)) * u, act_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _combine_sorted(rows_ptr, pos_ptr, rw_ptr, y_ptr, HIDDEN, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """y[token] = sum_k rw[token, k] * rows[pos[token * TOP_K + k]] in FP32, in k order, rounded once:
    `rows` holds the pairs sorted by expert, `pos` where each (token, k) pair went."""
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < HIDDEN
    acc = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(TOP_K):
        row = tl.load(pos_ptr + token * TOP_K + k).to(tl.int64)
        acc += tl.load(rw_ptr + token * TOP_K + k) * tl.load(rows_ptr + row * HIDDEN + offs, mask=ok,
                                                              other=0.0).to(tl.float32)
    tl.store(y_ptr + token * HIDDEN + offs, round_to(acc, y_ptr.dtype.element_ty), mask=ok)


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    act = torch.empty_like(g)
    block = 1024
    _swiglu[(triton.cdiv(g.numel(), block),)](g, u, act, g.numel(), BLOCK=block, num_warps=4)
    return act


def combine_sorted(rows: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor, top_k: int) -> torch.Tensor:
    n, hidden = pos.numel() // top_k, rows.shape[1]
    y = torch.empty(n, hidden, dtype=rows.dtype, device=rows.device)
    block = min(1024, triton.next_power_of_2(hidden))
    _combine_sorted[(n, triton.cdiv(hidden, block))](rows, pos, weights, y, hidden, TOP_K=top_k, BLOCK=block,
                                                    num_warps=4)
    return y
