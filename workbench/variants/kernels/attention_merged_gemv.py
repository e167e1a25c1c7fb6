"""Triton kernel of `attention_out:triton_merged`: at decode, attention:triton's split-K decode kernel
writes its partials, then ONE kernel runs o_proj with the merge and the gate in its prologue. Two
launches where attention_out:triton takes three (decode, merge-gate, GEMV): the merge-gate kernel's
launch, and the gated output's trip through memory, go; in their place every program re-reads the
partials of the heads it needs, from L2.

A program owns BLOCK_N rows of o_proj and HEADS query heads' columns of it (a split of K) for one
token: per head it merges the splits (`attention.merge_one_tile`), rounds to the model dtype as
`attention` does, gates in FP32 and rounds again as `attn_out` does, and multiplies into an FP32
accumulator. With several head groups, each writes its FP32 partial row and the last to arrive
(integer counter) adds them in group order: deterministic, no float atomics (docs/decisions.md #6).
Imported on the variant's first call (kernels need triton, and TRITON_INTERPRET set first under the
CPU interpreter).
"""

import torch
import triton
import triton.language as tl

from workbench.variants.kernels import attention as attn
from workbench.variants.kernels.arrivals import arrival_counters
from workbench.variants.kernels.triton_common import pdl_enter, pdl_launch, round_to

MAX_SPLITS = 64  # one [splits, head_dim] FP32 tile per program: a [64, 128] one is 64 registers a thread


@triton.jit
def _merged_gemv_kernel(m_ptr, l_ptr, acc_ptr, g_ptr, bias_ptr, w_ptr, out_ptr, part_ptr, count_ptr,
                        M, N, n_heads, head_dim, n_splits, g_stride,
                        HEADS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
                        BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (row tiles, head groups, tokens): y[token, rows] = o_proj[rows] . gated(token), gated's
    heads of this group merged from the split partials here."""
    pid_n, pid_k, token = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    k = n_heads * head_dim
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = rows < N
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    w_rows = w_ptr + rows[:, None].to(tl.int64) * k + d[None, :]
    w_ok = rows_ok[:, None] & d_ok[None, :]
    head0 = pid_k * HEADS
    if PDL:  # weights are never written: the first head's tile is read while the decode kernel finishes
        w_first = tl.load(w_rows + head0 * head_dim, mask=w_ok, other=0.0)
    pdl_enter(PDL)
    y = tl.zeros((BLOCK_N,), tl.float32)
    for i in range(HEADS):  # not unrolled: six heads' tiles in flight at once spill
        head = head0 + i
        if PDL:
            if i == 0:
                w = w_first
            else:
                w = tl.load(w_rows + head * head_dim, mask=w_ok, other=0.0)
        else:
            w = tl.load(w_rows + head * head_dim, mask=w_ok, other=0.0)
        o = attn.merge_one_tile(m_ptr, l_ptr, acc_ptr, (token * n_heads + head) * n_splits, n_splits, head_dim,
                                d, d_ok, BLOCK_S)
        o = round_to(o, out_ptr.dtype.element_ty).to(tl.float32)
        g = tl.load(g_ptr + token * g_stride + head * head_dim + d, mask=d_ok, other=0.0).to(tl.float32)
        b = tl.load(bias_ptr + head).to(tl.float32)
        x = round_to(o * (1.0 / (1.0 + tl.exp(-(g + b)))), out_ptr.dtype.element_ty).to(tl.float32)
        y += tl.sum(x[None, :] * w.to(tl.float32), axis=1)  # a head at a time: one [BLOCK_N] accumulator
    out_ok = rows_ok
    if SPLIT_K > 1:
        tl.store(part_ptr + (pid_k * M + token) * N + rows, y, mask=rows_ok)
        tl.debug_barrier()  # all threads' partials are written before the one-thread release below
        counter = count_ptr + token * tl.num_programs(0) + pid_n
        count = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        # only the last group to arrive adds the partials (a tile-shaped test: see kernels/gemv.py)
        out_ok = rows_ok & (tl.full((BLOCK_N,), SPLIT_K - 1, tl.int32) == count)
        y = tl.zeros((BLOCK_N,), tl.float32)
        for s in range(SPLIT_K):  # in group order, whichever group arrived last
            y += tl.load(part_ptr + (s * M + token) * N + rows, mask=out_ok, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(counter, 0, mask=count == SPLIT_K - 1)  # reset for the next launch
    tl.store(out_ptr + token * N + rows, round_to(y, out_ptr.dtype.element_ty), mask=out_ok)


def head_group(heads: int, want: int) -> int:
    """Heads a program takes: the largest divisor of `heads` that is at most `want`."""
    return max(h for h in range(1, min(want, heads) + 1) if heads % h == 0)


def merged_splits(q, cache, meta, window, cfg: dict) -> int:
    """The decode kernel's split count at this call (shapes only: graph-safe)."""
    batch, max_pages = meta.page_table.shape
    return attn.decode_splits(batch, cache.shape[3], max_pages, cache.shape[2], window, cfg, q.device)


def decode_merged(q, cache, meta, g, bias, o_proj, *, window, scale, attention_cfg: dict, merged_cfg: dict,
                  pdl: bool, splits: int) -> torch.Tensor:
    """y [N, hidden] of a decode step (one query per sequence): attention:triton's decode kernel at
    `attention_cfg` over `splits` splits (`merged_splits`, which the caller dispatched on) writing split
    partials, then the merged GEMV at `merged_cfg` (BLOCK_N, HEADS, num_warps, num_stages). No host
    reads: every size is a shape, a config value or the SM count."""
    attn.check_inputs(q, cache, window)
    q = q if q.stride(-1) == 1 else q.contiguous()
    g = g if g.stride(-1) == 1 else g.contiguous()
    o_proj = o_proj if o_proj.stride(-1) == 1 else o_proj.contiguous()
    n, heads, hd = q.shape
    hidden = o_proj.shape[0]
    attention_cfg = {**attention_cfg, "pdl": pdl}
    if splits > MAX_SPLITS:
        raise ValueError(f"attention_out:triton_merged merges at most {MAX_SPLITS} splits in a GEMV program, got "
                         f"{splits}: take attention_out:triton's kernels past max_splits")
    # never single or fused: this kernel merges (the decode kernel's `out` is then never written)
    unused = torch.empty((n, heads * hd), dtype=q.dtype, device=q.device)
    m, l_part, acc = attn.decode_launch(meta, attention_cfg, q=q, cache=cache, table=meta.page_table, out=unused,
                                        window=window, qk_scale=scale * attn.LOG2E, splits=splits, single=False,
                                        fused=False)
    per = head_group(heads, merged_cfg["HEADS"])
    split_k = heads // per
    tiles = triton.cdiv(hidden, merged_cfg["BLOCK_N"])
    y = torch.empty((n, hidden), dtype=q.dtype, device=q.device)
    part = torch.empty((split_k, n, hidden), dtype=torch.float32, device=q.device) if split_k > 1 else y
    counts = arrival_counters(n * tiles, q.device, "attention_out_merged") if split_k > 1 else m
    _merged_gemv_kernel[(tiles, split_k, n)](
        m, l_part, acc, g, bias, o_proj, y, part, counts, n, hidden, heads, hd, splits, g.stride(0),
        HEADS=per, SPLIT_K=split_k, BLOCK_N=merged_cfg["BLOCK_N"],
        BLOCK_S=triton.next_power_of_2(splits),
        BLOCK_D=triton.next_power_of_2(hd), num_warps=merged_cfg["num_warps"],
        num_stages=merged_cfg.get("num_stages", 1), **pdl_launch(pdl))
    return y

