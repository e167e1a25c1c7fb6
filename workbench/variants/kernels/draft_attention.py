"""Triton kernel of `draft_attention:triton`: a drafter block's rows against its keys, read in place.

The reference gathers every key a block sees into a new tensor, transposes queries, keys and output
around one attention call: five or more launches a draft layer. Here one kernel reads each key through
its (page, offset) straight from the store and the block's rows (all B rows of a block times the query
heads of one kv head: the M dimension of the dots, tiled by BLOCK_M) go through an FP32 online softmax
over the keys. The grid is (block x row tile, kv head, split): the keys are divided among SPLITS
programs whose partials `attention.merge_kernel` combines in a second launch; with one split the
kernel writes the output itself. Every size comes from shapes and the config, so a CUDA graph captures
it. The numerics are `kernels/attention.py`'s: exact 16-bit products into FP32 scores, the probabilities
held to FP32 precision in the PV dot, one rounding of the output.

Imported on the variant's first call (TRITON_INTERPRET must be set before the kernels are defined).
"""

import torch
import triton
import triton.language as tl

from workbench.variants.kernels.attention import (
    LOG2E,
    MAX_HEAD_DIM,
    MERGE_BLOCK_D,
    MERGE_MAX_SPLITS,
    MIN_DOT,
    PV_UNSCALE,
    dot,
    merge_kernel,
    normalised,
    softmax_block,
    v_block,
)
from workbench.variants.kernels.triton_common import INTERPRETED, pdl_enter, pdl_launch, round_to

DEFAULT = dict(BLOCK_M=64, BLOCK_N=64, SPLITS=1, num_warps=4, num_stages=2)
MASK_SCALE = tl.constexpr(LOG2E)  # the additive mask into the scores' log2 units


@triton.jit
def _block_kernel(q_ptr, store_ptr, pages_ptr, offsets_ptr, mask_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
                  stride_qn, stride_qh, stride_sp, stride_skv, stride_st, stride_sh, stride_pg, stride_of, stride_mk,
                  stride_on, stride_oh, n_keys, block, n_heads, head_dim, qk_scale,
                  GROUP: tl.constexpr, TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_N: tl.constexpr, SINGLE: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr,
                  PDL: tl.constexpr = False):
    """One (block, row tile; kv head; split): BLOCK_M of the block's (row, query head) pairs of this kv
    head against the split's share of the block's keys."""
    s = tl.program_id(0) // TILES
    tile = tl.program_id(0) % TILES
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    n_splits = tl.num_programs(2)
    pdl_enter(PDL)  # no weights: the queries and the block's keys are this step's

    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = r < block * GROUP
    rows = s.to(tl.int64) * block + r // GROUP
    heads = kvh * GROUP + r % GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(q_ptr + rows[:, None] * stride_qn + heads[:, None] * stride_qh + d[None, :],
                mask=r_ok[:, None] & d_ok[None, :], other=0.0)

    n_blocks = tl.cdiv(n_keys, BLOCK_N)
    per = tl.cdiv(n_blocks, n_splits)
    blk0 = split * per
    blk1 = tl.minimum(blk0 + per, n_blocks)
    kv_base = store_ptr + kvh.to(tl.int64) * stride_sh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for blk in range(blk0, blk1):
        j = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        add = tl.load(mask_ptr + s * stride_mk + j, mask=j < n_keys, other=float("-inf")).to(tl.float32)
        ok = add > float("-inf")  # a key that does not exist is never read: its slot may hold anything
        page = tl.load(pages_ptr + s * stride_pg + j, mask=ok, other=0)
        offset = tl.load(offsets_ptr + s * stride_of + j, mask=ok, other=0)
        key_rows = page.to(tl.int64) * stride_sp + offset.to(tl.int64) * stride_st
        k = tl.load(kv_base + key_rows[None, :] + d[:, None], mask=ok[None, :] & d_ok[:, None], other=0.0)
        v = v_block(kv_base, stride_skv, key_rows, ok, d, d_ok)
        scores = dot(q, k, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), IEEE, INTERP) * qk_scale \
            + add[None, :] * MASK_SCALE
        scores = tl.where(ok[None, :], scores, float("-inf"))
        m_i, l_i, acc = softmax_block(scores, v, m_i, l_i, acc, IEEE, INTERP)
    acc = acc * PV_UNSCALE

    if SINGLE:
        tl.store(out_ptr + rows[:, None] * stride_on + heads[:, None] * stride_oh + d[None, :],
                 round_to(normalised(acc, l_i), out_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])
    else:  # merge_kernel's layout: row (query row, head, split)
        part = (rows * n_heads + heads) * n_splits + split
        tl.store(m_ptr + part, m_i, mask=r_ok)
        tl.store(l_ptr + part, l_i, mask=r_ok)
        tl.store(acc_ptr + part[:, None] * head_dim + d[None, :], acc, mask=r_ok[:, None] & d_ok[None, :])


def check_inputs(q, store, pages, offsets, mask):
    n, heads, hd = q.shape
    if store.dim() != 5 or store.shape[1] != 2 or store.shape[4] != hd:
        raise ValueError(f"store must be [pages, 2, page_size, kv_heads, {hd}], got {tuple(store.shape)}")
    if heads % store.shape[3]:
        raise ValueError(f"draft_attention:triton needs heads ({heads}) a multiple of kv_heads ({store.shape[3]})")
    if hd > MAX_HEAD_DIM:
        raise ValueError(f"draft_attention:triton handles head_dim <= {MAX_HEAD_DIM}, got {hd}")
    if pages.shape != offsets.shape or pages.shape != mask.shape or pages.dim() != 2 or n % pages.shape[0]:
        raise ValueError(f"pages, offsets and mask must be one [blocks, keys] shape dividing the {n} rows, got "
                         f"{tuple(pages.shape)}, {tuple(offsets.shape)}, {tuple(mask.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or store.dtype != q.dtype:
        raise ValueError(f"draft_attention:triton takes bf16, fp16 or fp32 q and store of one dtype, got "
                         f"{q.dtype}, {store.dtype}")
    if store.stride(-1) != 1 or pages.stride(-1) != 1 or offsets.stride(-1) != 1 or mask.stride(-1) != 1:
        raise ValueError("draft_attention:triton needs the store, pages, offsets and mask contiguous in their last dim")


def block_attention(q, store, pages, offsets, mask, config: dict | None = None):
    """The `draft_attention` contract; `config` one of the variant's tuning configs (None: DEFAULT), plus an
    optional "pdl" (both launches with programmatic dependent launch)."""
    cfg = {**DEFAULT, **(config or {})}
    check_inputs(q, store, pages, offsets, mask)
    q = q if q.stride(-1) == 1 else q.contiguous()
    n, heads, hd = q.shape
    blocks, n_keys = pages.shape
    block, kv_heads = n // blocks, store.shape[3]
    group = heads // kv_heads
    out = torch.empty((n, heads, hd), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    block_m = max(MIN_DOT, min(cfg["BLOCK_M"], triton.next_power_of_2(block * group)))
    tiles = triton.cdiv(block * group, block_m)
    splits = max(1, min(cfg["SPLITS"], triton.cdiv(n_keys, cfg["BLOCK_N"]), MERGE_MAX_SPLITS))
    single = splits == 1
    if single:  # the kernel takes the scratch pointers either way; they are not touched
        m = l_part = acc = out
    else:
        m = torch.empty((n, heads, splits), dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m)
        acc = torch.empty((n, heads, splits, hd), dtype=torch.float32, device=q.device)
    pdl = pdl_launch(cfg.get("pdl"))
    _block_kernel[(blocks * tiles, kv_heads, splits)](
        q, store, pages, offsets, mask, out, m, l_part, acc, q.stride(0), q.stride(1),
        store.stride(0), store.stride(1), store.stride(2), store.stride(3), pages.stride(0), offsets.stride(0),
        mask.stride(0), out.stride(0), out.stride(1), n_keys, block, heads, hd, hd ** -0.5 * LOG2E,
        GROUP=group, TILES=tiles, BLOCK_M=block_m, BLOCK_D=max(MIN_DOT, triton.next_power_of_2(hd)),
        BLOCK_N=cfg["BLOCK_N"], SINGLE=single, IEEE=q.dtype == torch.float32, INTERP=INTERPRETED,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl)
    if not single:
        block_d = min(MERGE_BLOCK_D, triton.next_power_of_2(hd))
        merge_kernel[(n * heads, triton.cdiv(hd, block_d))](
            m, l_part, acc, out, out.stride(0), out.stride(1), heads, hd, splits,
            BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d, num_warps=4, **pdl)
    return out
