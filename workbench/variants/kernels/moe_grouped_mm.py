"""Triton kernels of `experts:grouped_mm` (`experts/grouped_mm.py`), also run by the quack variants: the
two element-wise steps around grouped GEMMs (SwiGLU, and the combine of rows sorted by expert).
Imported on a variant's first call, as `moe.py` is, so the point imports without triton and
TRITON_INTERPRET can be set before these kernels are defined."""

import torch
import triton
import triton.language as tl

from workbench.variants.kernels.moe import combine, swiglu_store


@triton.jit
def _swiglu(g_ptr, u_ptr, act_ptr, NUMEL, BLOCK: tl.constexpr):
    """act = silu(g) * u in FP32, rounded once to act's dtype (the reference's activation)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < NUMEL
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    swiglu_store(g, u, act_ptr + offs, ok)


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    act = torch.empty_like(g)
    block = 1024
    _swiglu[(triton.cdiv(g.numel(), block),)](g, u, act, g.numel(), BLOCK=block, num_warps=4)
    return act


def combine_sorted(rows: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor, top_k: int) -> torch.Tensor:
    """y[token] = sum_k weights[token, k] * rows[pos[token * top_k + k]]: `rows` holds the pairs sorted
    by expert, `pos` where each (token, k) pair went."""
    return combine(rows, weights, top_k, weighted=True, dtype=rows.dtype, pos=pos)
