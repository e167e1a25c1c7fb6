"""Triton kernels of `attention_out:triton`: at decode, attention:triton's split-K decode kernel writes
its partials, then ONE kernel merges each head's splits, rounds the attention output as `attention`
does, applies `attn_out`'s gate and rounds again, and the small-M GEMV (`kernels/gemv.linear`) runs
o_proj: three launches where attention:triton + attn_out:triton_gemv take four (decode, merge, gate,
GEMV). Prefill is `attention_three_launches`'s (the two points' Triton code one after the other).
Imported on the variant's first call (kernels need triton, and TRITON_INTERPRET set first under the
CPU interpreter).
"""

import torch
import triton
import triton.language as tl

from workbench.variants.kernels import attention as attn
from workbench.variants.kernels.triton_common import pdl_enter, pdl_launch, round_to


@triton.jit
def _merge_gate_kernel(m_ptr, l_ptr, acc_ptr, g_ptr, bias_ptr, out_ptr, g_stride, n_heads, head_dim, n_splits,
                       BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """One (token, query head, BLOCK_D of head_dim): merge the splits (attention's `merge_head`),
    round to the model dtype (attention's output), gate in FP32 as `attn_out` does, round once more."""
    pdl_enter(PDL)
    pid = tl.program_id(0).to(tl.int64)
    token, head = pid // n_heads, pid % n_heads
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    o = attn.merge_head(m_ptr, l_ptr, acc_ptr, pid * n_splits, n_splits, head_dim, d, d_ok, BLOCK_S, BLOCK_D)
    gate_store(o, g_ptr, bias_ptr, out_ptr, g_stride, token, head, n_heads, head_dim, d, d_ok)


@triton.jit
def gate_store(o, g_ptr, bias_ptr, out_ptr, g_stride, token, head, n_heads, head_dim, d, d_ok):
    """A merged head's columns `d` (FP32): round to the model dtype (attention's output), gate in FP32 as
    `attn_out` does, round once more, store into the gated output [tokens, heads * head_dim]."""
    o = round_to(o, out_ptr.dtype.element_ty).to(tl.float32)
    g = tl.load(g_ptr + token * g_stride + head * head_dim + d, mask=d_ok).to(tl.float32)
    b = tl.load(bias_ptr + head).to(tl.float32)
    gated = o * (1.0 / (1.0 + tl.exp(-(g + b))))  # sigmoid as torch computes it, apart from the product
    tl.store(out_ptr + token * n_heads * head_dim + head * head_dim + d, round_to(gated, out_ptr.dtype.element_ty),
             mask=d_ok)


def decode_gated(q, cache, meta, g, bias, *, window, scale, cfg: dict) -> torch.Tensor:
    """The gated attention output [N, heads * hd] of a decode step (one query per sequence):
    attention:triton's decode kernel at `cfg` always writing split partials (even one split), then the
    merge-gate kernel. No host reads: every size is a shape, a config value or the SM count."""
    attn.check_inputs(q, cache, window)
    q = q if q.stride(-1) == 1 else q.contiguous()
    g = g if g.stride(-1) == 1 else g.contiguous()
    table = meta.page_table
    batch, max_pages = table.shape
    heads, hd = q.shape[1], q.shape[2]
    splits = attn.decode_splits(batch, cache.shape[3], max_pages, cache.shape[2], window, cfg, q.device)
    gated = torch.empty((q.shape[0], heads * hd), dtype=q.dtype, device=q.device)
    # never single (its store would write `gated` unmerged), never fused: the merge-gate kernel merges
    m, l_part, acc = attn.decode_launch(meta, cfg, q=q, cache=cache, table=table, out=gated, window=window,
                                        qk_scale=scale * attn.LOG2E, splits=splits, single=False, fused=False)
    merge_gate(m, l_part, acc, g, bias, gated, splits, cfg)
    return gated


def merge_gate(m, l_part, acc, g, bias, gated, splits: int, cfg: dict) -> None:
    """The merge-gate kernel over a decode kernel's split partials (m, l, acc) into `gated`."""
    n, heads, hd = acc.shape[0], acc.shape[1], acc.shape[3]
    block_d = min(attn.MERGE_BLOCK_D, triton.next_power_of_2(hd))
    _merge_gate_kernel[(n * heads, triton.cdiv(hd, block_d))](
        m, l_part, acc, g, bias, gated, g.stride(0), heads, hd, splits,
        BLOCK_S=min(attn.MERGE_MAX_SPLITS, triton.next_power_of_2(splits)), BLOCK_D=block_d, num_warps=4,
        **pdl_launch(cfg.get("pdl")))
