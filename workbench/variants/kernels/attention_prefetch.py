"""Triton kernel of `attention:triton_prefetch`: attention:triton's split-K decode with each split's
first key block loaded before the PDL wait (`kernels/attention.py` has the contract, the paging and
the numerics; this kernel repeats its decode kernel's arithmetic exactly, so the bits are the same).

Why: a decode kernel launched with programmatic dependent launch starts while the kernel before it
(qk_prep, which writes the query and the query's own K/V) still runs, but attention:triton's decode
waits before any load, so its whole KV stream starts after that kernel ends. At batch 1 and 32K keys
a read-only kernel of the same bytes is a fifth faster when it loads first than when it waits first
(docs/findings.md, `gpu_attention_read_floor.py`). Before the wait this kernel reads
only what no kernel of the step writes: lengths, positions and page tables (the host's inputs of the
step) and every key before the query's own (the cache rows of earlier steps, on pages only this
sequence holds); the query and the query's own K/V row are read after it.
A split of one block (32K keys at BLOCK_N 128 and 256 splits; a 512-key window at BLOCK_N 32) then has
its whole share of the KV in flight before the wait. Splits are merged by attention:triton's merge
kernel; there is no fused-merge or EARLY_V form: V is loaded beside K before the wait, or (configs
with PREFETCH_V False) after the scores, so only K's tile is held across the wait.
"""

import torch
import triton
import triton.language as tl

from workbench.variants.kernels import attention as base
from workbench.variants.kernels.attention import (
    MERGE_BLOCK_D,
    MERGE_MAX_SPLITS,
    MIN_DOT,
    PV_UNSCALE,
    dot,
    kv_rows,
    normalised,
    softmax_block,
    v_block,
)
from workbench.variants.kernels.attention_gated_merge import merge_gate
from workbench.variants.kernels.triton_common import INTERPRETED, pdl_launch, pdl_release, pdl_wait, round_to


@triton.jit
def _k_block(kv_base, rows, ok, d, d_ok):
    """A key block's K rows, transposed [BLOCK_D, BLOCK_N] (0 where not readable)."""
    return tl.load(kv_base + rows[None, :] + d[:, None], mask=ok[None, :] & d_ok[:, None], other=0.0)


@triton.jit
def _decode_prefetch_kernel(q_ptr, cache_ptr, table_ptr, seq_lens_ptr, pos_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
                            stride_qn, stride_qh, stride_cp, stride_ckv, stride_ct, stride_ch, stride_tb,
                            stride_on, stride_oh, max_pages, window, qk_scale, n_heads, head_dim,
                            GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                            BLOCK_N: tl.constexpr, PAGE: tl.constexpr, HAS_WINDOW: tl.constexpr,
                            SINGLE: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr,
                            PDL: tl.constexpr = False, PREFETCH_V: tl.constexpr = True,
                            OWN_KEY_AFTER_WAIT: tl.constexpr = True):
    """One (sequence, kv head, split), as `kernels/attention._decode_kernel`. PREFETCH_V=False loads only
    the first block's K before the wait and its V after the scores (one tile held across the wait, not
    two). OWN_KEY_AFTER_WAIT=False loads the query's own K/V row before the wait too: wrong (a planted
    fault for the GPU test)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    n_splits = tl.num_programs(2)
    pdl_release(PDL)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    pos = tl.load(pos_ptr + b).to(tl.int32)
    hi = tl.minimum(pos + 1, seq_len)
    if HAS_WINDOW:
        lo = tl.maximum(pos - window + 1, 0)
    else:
        lo = pos * 0
    first = lo // BLOCK_N
    last = tl.maximum(tl.cdiv(hi, BLOCK_N), first)
    per = tl.cdiv(last - first, n_splits)
    blk0 = first + split * per
    blk1 = tl.minimum(blk0 + per, last)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    g_ok = g < GROUP
    d_ok = d < head_dim
    table_row = table_ptr + b.to(tl.int64) * stride_tb
    kv_base = cache_ptr + kvh.to(tl.int64) * stride_ch

    keys = blk0 * BLOCK_N + tl.arange(0, BLOCK_N)
    rows, ok = kv_rows(table_row, keys, lo, hi, max_pages, stride_cp, stride_ct, PAGE)
    ok = ok & (keys < blk1 * BLOCK_N)  # an empty split (blk0 >= blk1) reads nothing
    if OWN_KEY_AFTER_WAIT:
        early = ok & (keys != pos)  # earlier steps' keys: no kernel of this step writes them
        own = ok & (keys == pos)    # the query's own row, written by the kernel before (one key of one split)
    else:
        early = ok
        own = ok & (keys < 0)
    k = _k_block(kv_base, rows, early, d, d_ok)
    if PREFETCH_V:
        v = v_block(kv_base, stride_ckv, rows, early, d, d_ok)
    pdl_wait(PDL)
    # the own row as one vector (a tile-wide masked reload would hold a second tile), put in its column
    own_d = d_ok & (d * 0 + tl.sum(own.to(tl.int32), 0) > 0)  # [BLOCK_D]: this split holds the own key
    own_row = kv_base + tl.sum(tl.where(own, rows, 0), 0)
    k = tl.where(own[None, :], tl.load(own_row + d, mask=own_d, other=0.0)[:, None], k)
    if PREFETCH_V:
        v = tl.where(own[:, None], tl.load(own_row + stride_ckv + d, mask=own_d, other=0.0)[None, :], v)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qn + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if blk0 < blk1:
        s = dot(q, k, tl.zeros([BLOCK_G, BLOCK_N], tl.float32), IEEE, INTERP) * qk_scale  # log2 units
        s = tl.where(ok[None, :], s, float("-inf"))
        if not PREFETCH_V:
            v = v_block(kv_base, stride_ckv, rows, ok, d, d_ok)
        m_i, l_i, acc = softmax_block(s, v, m_i, l_i, acc, IEEE, INTERP)
    for blk in range(blk0 + 1, blk1):  # a split of several blocks: the rest after the wait
        keys = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        rows, ok = kv_rows(table_row, keys, lo, hi, max_pages, stride_cp, stride_ct, PAGE)
        k = _k_block(kv_base, rows, ok, d, d_ok)
        s = dot(q, k, tl.zeros([BLOCK_G, BLOCK_N], tl.float32), IEEE, INTERP) * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        v = v_block(kv_base, stride_ckv, rows, ok, d, d_ok)
        m_i, l_i, acc = softmax_block(s, v, m_i, l_i, acc, IEEE, INTERP)
    acc = acc * PV_UNSCALE

    if SINGLE:
        o = normalised(acc, l_i)
        tl.store(out_ptr + b.to(tl.int64) * stride_on + heads[:, None] * stride_oh + d[None, :],
                 round_to(o, out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    else:  # every split's partials, empty ones as (-inf, 0, 0), for the merge kernel
        row = (b.to(tl.int64) * n_heads + heads) * n_splits + split
        tl.store(m_ptr + row, m_i, mask=g_ok)
        tl.store(l_ptr + row, l_i, mask=g_ok)
        tl.store(acc_ptr + row[:, None] * head_dim + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])


def merge_splits(m, l_part, acc, out, splits: int, cfg: dict) -> None:
    """attention:triton's merge kernel over a decode kernel's split partials (m, l, acc) into `out`."""
    n, heads, hd = out.shape
    block_d = min(MERGE_BLOCK_D, triton.next_power_of_2(hd))
    base.merge_kernel[(n * heads, triton.cdiv(hd, block_d))](
        m, l_part, acc, out, out.stride(0), out.stride(1), heads, hd, splits,
        BLOCK_S=min(MERGE_MAX_SPLITS, triton.next_power_of_2(splits)), BLOCK_D=block_d, num_warps=4,
        **pdl_launch(cfg.get("pdl")))


def paged_attention(q, cache, meta, *, window, scale, config: dict | None = None, own_key_after_wait=True,
                    merge=merge_splits):
    """The `attention` contract: decode by the kernel above, prefill by attention:triton's. `merge`: the
    splits' merge, as `merge_splits` is called."""
    cfg = {**base.DEFAULT, **(config or {})}
    if not meta.decode:
        return base.paged_attention(q, cache, meta, window=window, scale=scale, config=cfg)
    base.check_inputs(q, cache, window)
    q = q if q.stride(-1) == 1 else q.contiguous()
    n, heads, hd = q.shape
    out = torch.empty((n, heads, hd), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    splits = _splits(q, cache, meta, window, cfg)
    m, l_part, acc = decode_launch(meta, cfg, q=q, cache=cache, out=out, window=window, scale=scale, splits=splits,
                                   single=splits == 1, own_key_after_wait=own_key_after_wait)
    if splits > 1:
        merge(m, l_part, acc, out, splits, cfg)
    return out


def decode_gated(q, cache, meta, g, bias, *, window, scale, cfg: dict, merge=merge_gate) -> torch.Tensor:
    """`attention_gated_merge.decode_gated` (attention_out:triton's decode: split partials always, then
    its merge-gate kernel) with this module's decode kernel. `cfg`: a full attention config; `merge`:
    the merge-gate, as `attention_gated_merge.merge_gate` is called."""
    base.check_inputs(q, cache, window)
    q = q if q.stride(-1) == 1 else q.contiguous()
    g = g if g.stride(-1) == 1 else g.contiguous()
    n, heads, hd = q.shape
    splits = _splits(q, cache, meta, window, cfg)
    gated = torch.empty((n, heads * hd), dtype=q.dtype, device=q.device)
    m, l_part, acc = decode_launch(meta, cfg, q=q, cache=cache, out=gated, window=window, scale=scale,
                                   splits=splits, single=False)
    merge(m, l_part, acc, g, bias, gated, splits, cfg)
    return gated


def _splits(q, cache, meta, window, cfg) -> int:
    batch, max_pages = meta.page_table.shape
    if q.shape[0] != batch:
        raise ValueError(f"decode needs one query per sequence: {q.shape[0]} queries, {batch} page-table rows")
    return base.decode_splits(batch, cache.shape[3], max_pages, cache.shape[2], window, cfg, q.device)


def decode_launch(meta, cfg, *, q, cache, out, window, scale, splits, single, own_key_after_wait=True):
    """The decode kernel over `splits` splits a (sequence, kv head); returns the split partials
    (m, l, acc) it wrote for a merge, unless `single` (then it wrote `out` and they are unused)."""
    table = meta.page_table
    batch, max_pages = table.shape
    heads, hd = q.shape[1], q.shape[2]
    page, kv_heads = cache.shape[2], cache.shape[3]
    if single:  # the kernel takes the scratch pointers either way; they are not touched
        m = l_part = acc = out
    else:
        m = torch.empty((batch, heads, splits), dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m)
        acc = torch.empty((batch, heads, splits, hd), dtype=torch.float32, device=q.device)
    group = heads // kv_heads
    _decode_prefetch_kernel[(batch, kv_heads, splits)](
        q, cache, table, meta.seq_lens, meta.positions, out, m, l_part, acc,
        *base.strides(q, cache, table, out), max_pages, window or 0, scale * base.LOG2E, heads, hd,
        GROUP=group, BLOCK_G=max(MIN_DOT, triton.next_power_of_2(group)),
        BLOCK_D=max(MIN_DOT, triton.next_power_of_2(hd)), BLOCK_N=cfg["BLOCK_N"], PAGE=page,
        HAS_WINDOW=window is not None, SINGLE=single, IEEE=q.dtype == torch.float32, INTERP=INTERPRETED,
        PREFETCH_V=cfg.get("PREFETCH_V", True), OWN_KEY_AFTER_WAIT=own_key_after_wait,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch(cfg.get("pdl")))
    return m, l_part, acc
