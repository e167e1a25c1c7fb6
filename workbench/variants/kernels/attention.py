"""Triton kernels of the `attention:triton` variant: portable paged attention over the KV cache (the
contract: `workbench/variants/attention/__init__.py`). Imported on a variant's first call, never by a
variant module at import time, so the variants register without triton and TRITON_INTERPRET can still
be set before these kernels are defined. The prefetch, wide-merge and `attention_out` kernels build on
its public pieces (`decode_launch`, `merge_head`, `merge_kernel`, the block helpers).

Two paths, both reading K/V straight from the paged cache [pages, 2, page_size, kv_heads, hd]:
- decode (`meta.decode`, one query per sequence): split-K flash-decoding. The grid is (sequence,
  kv head, split); a program holds the whole GQA group of its kv head as the M dimension of its dots
  (padded to 16 rows), walks its share of the query's visible key blocks (on sliding layers only the
  blocks of the last `window` keys: the loop starts at the window's first block, so the work is
  ~window keys whatever the context) with an FP32 online softmax, and writes partial (max, sum, acc).
  A small kernel merges the splits, all of a head's splits in one tile; or (configs with
  FUSED_MERGE_MAX_SPLITS, at most that many splits) the last split program of a (sequence, kv head)
  to finish merges them with the same code (`merge_head`), which saves the second launch of a
  short, latency-bound decode (a sliding window): both give the same bits. With one split the decode
  kernel writes the output itself. Configs with EARLY_V load each block's V beside its K rather than
  after the scores, so a split of one block waits on memory once instead of twice. The number of
  splits and every launch size come from tensor shapes and the device's SM count only (page_table's
  width, not the sequences' lengths), and lengths / positions are read on the device, so a decode
  step is CUDA-graph capturable and replays right with new contents.
- prefill (ragged chunks): flash attention, one program per (block of a sequence's queries, query
  head), looping only over the key blocks some query of the block can see (causal + window).
  The grid is sized from the host copy of the ragged layout; prefill runs eagerly, never in graphs.

Numerics as the reference: scores, softmax and the weighted sum in FP32, output rounded once. QK^T
multiplies 16-bit operands exactly into FP32. The probabilities are FP32; for 16-bit V they enter
the PV dot as a sum of 16-bit terms that holds them to FP32 precision (3 BF16 or 2 FP16 terms, see
`_dot_pv`; a single BF16 cast, as FlashAttention does, keeps 8 bits and moves near-zero outputs by
several ulps), so tensor cores still do the work, at 2-3x the PV dot's cost. FP32 inputs use IEEE
FP32 dots (never TF32).

This module must never read a page whose page_table entry is -1, nor any K/V row outside a query's
visible range: such rows may hold stale NaN, so they are masked at the load (other=0) and never
multiplied by a zero weight. It must never sync with the host on the decode path, and uses atomics
only to count the splits that have finished, never to sum values (every output element is written by
one program, merging in a fixed order whichever program arrives last: results are bitwise reproducible).
"""

import functools
import math

import torch
import triton
import triton.language as tl

from workbench.variants.kernels.arrivals import arrival_counters
from workbench.variants.kernels.triton_common import INTERPRETED, pdl_enter, pdl_launch, round_to

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256   # one [rows, head_dim] FP32 accumulator per program must fit in registers
MAX_GROUP = 64       # query heads per kv head a decode program holds at once
MIN_DOT = 16         # tl.dot needs every dimension >= 16 on the GPU
PV_SCALE = tl.constexpr(2.0 ** 15)  # see _dot_pv: exact, and p * PV_SCALE <= 32768 fits FP16
PV_UNSCALE = tl.constexpr(2.0 ** -15)
MERGE_MAX_SPLITS = 256  # splits one merge tile holds (a [256, 32] FP32 tile: 64 registers a thread)
MERGE_BLOCK_D = 32      # head_dim columns per merge program

# Defaults when no tuning config is given; it is also `attention_configs.TRITON_CONFIGS[0]` (a test checks).
DEFAULT = dict(BLOCK_N=64, MIN_BLOCKS=1, WAVES=2, MAX_SPLITS=256, num_warps=4, num_stages=2,
               PREFILL_BLOCK_M=64, PREFILL_BLOCK_N=64, PREFILL_WARPS=4, PREFILL_STAGES=2, FUSED_MERGE_MAX_SPLITS=0,
               EARLY_V=False)


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr, INTERP: tl.constexpr):
    """acc + a @ b with FP32 accumulation. The interpreter's tl.dot multiplies 16-bit floats as raw
    bits, so interpreted dots take exact FP32 copies (16-bit products are exact in FP32 either way)."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _dot_pv(p, v, acc, IEEE: tl.constexpr, INTERP: tl.constexpr):
    """acc + (p * PV_SCALE) @ v for FP32 probabilities p <= 1: an exact FP32 dot for FP32 V; for
    16-bit V, p split into 16-bit terms that sum to it within FP32 precision (a single cast would keep
    8 bits of p in BF16): hi + mid + lo in BF16 (3 x 8 bits), hi + lo in FP16 (2 x 11 bits). Each
    16-bit product is exact in FP32. p is scaled by 2^15 (exact) so FP16's low term stays clear of its
    subnormals; the accumulator is in those units until the caller multiplies by PV_UNSCALE."""
    x = p * PV_SCALE
    if IEEE:
        return dot(x, v, acc, True, INTERP)
    else:
        hi = x.to(v.dtype)
        x = x - hi.to(tl.float32)
        acc = dot(hi, v, acc, False, INTERP)
        if v.dtype == tl.bfloat16:
            mid = x.to(v.dtype)
            x = x - mid.to(tl.float32)
            acc = dot(mid, v, acc, False, INTERP)
        return dot(x.to(v.dtype), v, acc, False, INTERP)


@triton.jit
def kv_rows(table_row_ptr, keys, lo, hi, max_pages, stride_page, stride_tok, PAGE: tl.constexpr):
    """Cache offsets of `keys` (absolute positions) and whether each may be read: inside [lo, hi) and
    on a page the sequence holds (page_table -1 = released or never held: never read)."""
    in_range = (keys >= lo) & (keys < hi)
    logical = keys // PAGE
    page = tl.load(table_row_ptr + logical, mask=in_range & (logical < max_pages), other=-1)
    ok = in_range & (page >= 0)
    return page.to(tl.int64) * stride_page + (keys % PAGE).to(tl.int64) * stride_tok, ok


@triton.jit
def v_block(kv_base, stride_ckv, rows, ok, d, d_ok):
    """A key block's V rows [BLOCK_N, BLOCK_D] (0 where not readable)."""
    return tl.load(kv_base + stride_ckv + rows[:, None] + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def softmax_block(s, v, m_i, l_i, acc, IEEE: tl.constexpr, INTERP: tl.constexpr):
    """One key block of the online softmax: masked scores s (log2 units, -inf where unseen) and the
    block's V rows folded into (m_i, l_i, acc)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: exp2(-inf - 0) = 0, not NaN
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _dot_pv(p, v, acc * alpha[:, None], IEEE, INTERP)
    return m_new, l_i, acc


@triton.jit
def normalised(acc, l_i):
    """acc / l, and 0 for a query that saw no key (never 0 / 0)."""
    return tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)


@triton.jit
def _decode_kernel(q_ptr, cache_ptr, table_ptr, seq_lens_ptr, pos_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, count_ptr,
                   stride_qn, stride_qh, stride_cp, stride_ckv, stride_ct, stride_ch, stride_tb,
                   stride_on, stride_oh, max_pages, window, qk_scale, n_heads, head_dim,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   PAGE: tl.constexpr, HAS_WINDOW: tl.constexpr, SINGLE: tl.constexpr, FUSED_MERGE: tl.constexpr,
                   MERGE_BLOCK_S: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr,
                   EARLY_V: tl.constexpr = False, PDL: tl.constexpr = False):
    """One (sequence, kv head, split): its GQA group's queries against its share of the visible keys.

    Keys are walked in BLOCK_N-aligned blocks from the block holding the first visible key (the
    window's start on sliding layers) to the one holding the query; the blocks are divided evenly
    among the splits at run time, from lengths read here, so the launch never depends on them."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    n_splits = tl.num_programs(2)
    pdl_enter(PDL)  # no weights: q, the cache, lengths, pages and counters may all be the last kernel's
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
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qn + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    table_row = table_ptr + b.to(tl.int64) * stride_tb
    kv_base = cache_ptr + kvh.to(tl.int64) * stride_ch

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for blk in range(blk0, blk1):
        keys = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        rows, ok = kv_rows(table_row, keys, lo, hi, max_pages, stride_cp, stride_ct, PAGE)
        k = tl.load(kv_base + rows[None, :] + d[:, None], mask=ok[None, :] & d_ok[:, None], other=0.0)
        if EARLY_V:  # V's load in flight beside K's: a short split (one block) waits for memory once
            v = v_block(kv_base, stride_ckv, rows, ok, d, d_ok)
        s = dot(q, k, tl.zeros([BLOCK_G, BLOCK_N], tl.float32), IEEE, INTERP) * qk_scale  # log2 units
        s = tl.where(ok[None, :], s, float("-inf"))
        if not EARLY_V:
            v = v_block(kv_base, stride_ckv, rows, ok, d, d_ok)
        m_i, l_i, acc = softmax_block(s, v, m_i, l_i, acc, IEEE, INTERP)
    acc = acc * PV_UNSCALE

    if SINGLE:  # one split: normalise and round here, no scratch and no second launch
        o = normalised(acc, l_i)
        tl.store(out_ptr + b.to(tl.int64) * stride_on + heads[:, None] * stride_oh + d[None, :],
                 round_to(o, out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    else:  # partials of every split are written, empty ones as (-inf, 0, 0): the merge reads them all
        row = (b.to(tl.int64) * n_heads + heads) * n_splits + split
        tl.store(m_ptr + row, m_i, mask=g_ok)
        tl.store(l_ptr + row, l_i, mask=g_ok)
        tl.store(acc_ptr + row[:, None] * head_dim + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
        if FUSED_MERGE:
            # Every thread's stores above come before the count moves (barrier, then a release); the
            # program that counts last acquires them all, merges, and leaves the counter at 0 again.
            tl.debug_barrier()
            counter = count_ptr + b * tl.num_programs(1) + kvh
            if tl.atomic_add(counter, 1, sem="acq_rel") == n_splits - 1:
                for h in tl.static_range(GROUP):  # unrolled: the heads' loads need not wait on each other
                    head = kvh * GROUP + h
                    o = merge_head(m_ptr, l_ptr, acc_ptr, (b.to(tl.int64) * n_heads + head) * n_splits, n_splits,
                                   head_dim, d, d_ok, MERGE_BLOCK_S, BLOCK_D)
                    tl.store(out_ptr + b.to(tl.int64) * stride_on + head * stride_oh + d,
                             round_to(o, out_ptr.dtype.element_ty), mask=d_ok)
                tl.atomic_xchg(counter, 0)


@triton.jit
def merge_head(m_ptr, l_ptr, acc_ptr, base, n_splits, head_dim, d, d_ok,
               BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """One query head's output columns `d` from its splits' partials (rows base .. base + n_splits):
    FP32, BLOCK_S splits per tile, so up to BLOCK_S splits cost one wait on memory per load, where
    walking them one by one waited once per split. Loads bypass L1 (".cg"): in the fused merge, other
    programs wrote these rows during this kernel."""
    s = tl.arange(0, BLOCK_S)
    m_max = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):
        m_max = tl.maximum(m_max, tl.load(m_ptr + base + s0 + s, mask=s0 + s < n_splits, other=float("-inf"),
                                          cache_modifier=".cg"))
    m = tl.max(m_max, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    l_sum = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):
        ok = s0 + s < n_splits
        w = tl.math.exp2(tl.load(m_ptr + base + s0 + s, mask=ok, other=float("-inf"), cache_modifier=".cg") - m)
        l_sum += w * tl.load(l_ptr + base + s0 + s, mask=ok, other=0.0, cache_modifier=".cg")
        a = tl.load(acc_ptr + (base + s0 + s)[:, None] * head_dim + d[None, :], mask=ok[:, None] & d_ok[None, :],
                    other=0.0, cache_modifier=".cg")
        acc += w[:, None] * a
    total = tl.sum(l_sum, 0)
    return tl.sum(acc, 0) / tl.where(total > 0, total, 1.0)  # no visible key at all: 0, not 0/0


@triton.jit
def merge_one_tile(m_ptr, l_ptr, acc_ptr, base, n_splits, head_dim, d, d_ok, BLOCK_S: tl.constexpr):
    """`merge_head` for n_splits <= BLOCK_S: every split's max, sum and accumulator loaded
    at once (one wait on L2 where the general merge, a loop over tiles, waits twice), then the same
    arithmetic in the same order."""
    s = tl.arange(0, BLOCK_S)
    ok = s < n_splits
    m = tl.load(m_ptr + base + s, mask=ok, other=float("-inf"), cache_modifier=".cg")
    l_part = tl.load(l_ptr + base + s, mask=ok, other=0.0, cache_modifier=".cg")
    a = tl.load(acc_ptr + (base + s)[:, None] * head_dim + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0,
                cache_modifier=".cg")
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_max)
    total = tl.sum(w * l_part, 0)
    return tl.sum(w[:, None] * a, 0) / tl.where(total > 0, total, 1.0)  # no visible key at all: 0, not 0/0


@triton.jit
def merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, stride_on, stride_oh, n_heads, head_dim, n_splits,
                 BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """One (sequence, query head, BLOCK_D of head_dim): combine the splits' partials, round once.
    BLOCK_S covers every split (up to 256): at batch 1 with one kv head a 32K-token decode has 256
    splits, and a program per head walking them 16 at a time was latency-bound."""
    pdl_enter(PDL)
    pid = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    o = merge_head(m_ptr, l_ptr, acc_ptr, pid * n_splits, n_splits, head_dim, d, d_ok, BLOCK_S, BLOCK_D)
    out = out_ptr + (pid // n_heads) * stride_on + (pid % n_heads) * stride_oh + d
    tl.store(out, round_to(o, out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _prefill_kernel(q_ptr, cache_ptr, table_ptr, seq_lens_ptr, pos_ptr, qstart_ptr, out_ptr,
                    stride_qn, stride_qh, stride_cp, stride_ckv, stride_ct, stride_ch, stride_tb,
                    stride_on, stride_oh, max_pages, window, qk_scale, head_dim,
                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    PAGE: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr,
                    PDL: tl.constexpr = False):
    """One (block of a sequence's queries, query head): causal + window flash attention over the
    key blocks at least one of its queries sees. Programs past a sequence's last query do nothing."""
    # Latest query blocks first: they see the most keys, so the long programs start in the first wave.
    mblk = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    pdl_enter(PDL)
    q0 = tl.load(qstart_ptr + b)
    n_q = tl.load(qstart_ptr + b + 1) - q0
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    r = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = r < n_q
    tok = (q0 + r).to(tl.int64)
    pos = tl.load(pos_ptr + tok, mask=r_ok, other=0).to(tl.int32)
    hi_row = tl.minimum(pos + 1, seq_len)  # each query's keys: [lo_row, hi_row)
    if HAS_WINDOW:
        lo_row = tl.maximum(pos - window + 1, 0)
    else:
        lo_row = pos * 0
    hi = tl.max(tl.where(r_ok, hi_row, 0), 0)
    lo = tl.min(tl.where(r_ok, lo_row, 2147483647), 0)  # no live row: lo > hi, the loop is empty
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(q_ptr + tok[:, None] * stride_qn + h * stride_qh + d[None, :], mask=r_ok[:, None] & d_ok[None, :],
                other=0.0)
    table_row = table_ptr + b.to(tl.int64) * stride_tb
    kv_base = cache_ptr + (h // GROUP).to(tl.int64) * stride_ch

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for blk in range(lo // BLOCK_N, tl.cdiv(hi, BLOCK_N)):
        keys = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        rows, ok = kv_rows(table_row, keys, lo, hi, max_pages, stride_cp, stride_ct, PAGE)
        k = tl.load(kv_base + rows[None, :] + d[:, None], mask=ok[None, :] & d_ok[:, None], other=0.0)
        s = dot(q, k, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), IEEE, INTERP) * qk_scale  # log2 units
        seen = ok[None, :] & (keys[None, :] >= lo_row[:, None]) & (keys[None, :] < hi_row[:, None])
        s = tl.where(seen, s, float("-inf"))
        v = v_block(kv_base, stride_ckv, rows, ok, d, d_ok)
        m_i, l_i, acc = softmax_block(s, v, m_i, l_i, acc, IEEE, INTERP)
    acc = acc * PV_UNSCALE
    o = normalised(acc, l_i)
    tl.store(out_ptr + tok[:, None] * stride_on + h * stride_oh + d[None, :], round_to(o, out_ptr.dtype.element_ty),
             mask=r_ok[:, None] & d_ok[None, :])


# ---- host side -----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the CPU interpreter: a few "SMs", so small tests still take several splits


def decode_splits(batch: int, kv_heads: int, max_pages: int, page_size: int, window, cfg: dict, device) -> int:
    """Splits per (sequence, kv head): enough programs for WAVES waves over the SMs, each covering at
    least MIN_BLOCKS key blocks of the longest visible range the page table allows. Shapes only."""
    bn = cfg["BLOCK_N"]
    blocks = math.ceil(max_pages * page_size / bn)
    if window is not None:  # window keys touch at most this many aligned blocks, whatever the context
        blocks = min(blocks, math.ceil((window - 1) / bn) + 1)
    want = math.ceil(cfg["WAVES"] * _sm_count(device) / (batch * kv_heads))
    return max(1, min(cfg["MAX_SPLITS"], math.ceil(blocks / cfg["MIN_BLOCKS"]), want))


def check_inputs(q, cache, window):
    n, heads, hd = q.shape
    kv_heads = cache.shape[3]
    if cache.dim() != 5 or cache.shape[1] != 2 or cache.shape[4] != hd:
        raise ValueError(f"cache must be [pages, 2, page_size, kv_heads, {hd}], got {tuple(cache.shape)}")
    if heads % kv_heads or heads // kv_heads > MAX_GROUP:
        raise ValueError(f"attention:triton needs heads a multiple of kv_heads, <= {MAX_GROUP} per kv head")
    if hd > MAX_HEAD_DIM:
        raise ValueError(f"attention:triton handles head_dim <= {MAX_HEAD_DIM}, got {hd}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or cache.dtype != q.dtype:
        raise ValueError(f"attention:triton takes bf16, fp16 or fp32 q and cache of one dtype, got {q.dtype}, "
                         f"{cache.dtype}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    if cache.stride(-1) != 1:
        raise ValueError("attention:triton needs the cache contiguous along head_dim")


def paged_attention(q, cache, meta, *, window, scale, config: dict | None = None):
    """The `attention` contract; `config` is one of the variant's tuning configs (None: DEFAULT), plus
    an optional "pdl" (every launch with programmatic dependent launch, see `pdl_launch`)."""
    cfg = {**DEFAULT, **(config or {})}
    check_inputs(q, cache, window)
    q = q if q.stride(-1) == 1 else q.contiguous()
    n, heads, hd = q.shape
    out = torch.empty((n, heads, hd), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    table = meta.page_table
    common = dict(q=q, cache=cache, table=table, out=out, window=window, qk_scale=scale * LOG2E)
    if meta.decode:
        _decode(meta, cfg, **common)
    else:
        _prefill(meta, cfg, **common)
    return out


def strides(q, cache, table, out):
    return (q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
            table.stride(0), out.stride(0), out.stride(1))


def _decode(meta, cfg, *, q, cache, table, out, window, qk_scale):
    """No host reads: every size below is a shape, a config value or the device's SM count."""
    batch, max_pages = table.shape
    page, kv_heads = cache.shape[2], cache.shape[3]
    splits = decode_splits(batch, kv_heads, max_pages, page, window, cfg, q.device)
    single = splits == 1
    fused = not single and splits <= cfg["FUSED_MERGE_MAX_SPLITS"]
    m, l_part, acc = decode_launch(meta, cfg, q=q, cache=cache, table=table, out=out, window=window,
                                   qk_scale=qk_scale, splits=splits, single=single, fused=fused)
    if not single and not fused:
        heads, hd = q.shape[1], q.shape[2]
        block_d = min(MERGE_BLOCK_D, triton.next_power_of_2(hd))
        merge_kernel[(batch * heads, triton.cdiv(hd, block_d))](
            m, l_part, acc, out, out.stride(0), out.stride(1), heads, hd, splits,
            BLOCK_S=min(MERGE_MAX_SPLITS, triton.next_power_of_2(splits)), BLOCK_D=block_d, num_warps=4,
            **pdl_launch(cfg.get("pdl")))


def decode_launch(meta, cfg, *, q, cache, table, out, window, qk_scale, splits, single, fused):
    """The decode kernel over `splits` splits a (sequence, kv head). Returns the split partials
    (m, l, acc) it wrote, which the caller merges unless `single` or `fused` (then they are unused)."""
    batch, max_pages = table.shape
    n, heads, hd = q.shape
    if n != batch:
        raise ValueError(f"decode needs one query per sequence: {n} queries, {batch} page-table rows")
    page, kv_heads = cache.shape[2], cache.shape[3]
    group = heads // kv_heads
    if single:  # the kernel takes the scratch pointers either way; they are not touched
        m = l_part = acc = out
    else:
        m = torch.empty((batch, heads, splits), dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m)
        acc = torch.empty((batch, heads, splits, hd), dtype=torch.float32, device=q.device)
    counts = arrival_counters(batch * kv_heads, q.device, "attention") if fused else m
    block_d = max(MIN_DOT, triton.next_power_of_2(hd))
    _decode_kernel[(batch, kv_heads, splits)](
        q, cache, table, meta.seq_lens, meta.positions, out, m, l_part, acc, counts, *strides(q, cache, table, out),
        max_pages, window or 0, qk_scale, heads, hd,
        GROUP=group, BLOCK_G=max(MIN_DOT, triton.next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_N=cfg["BLOCK_N"], PAGE=page, HAS_WINDOW=window is not None, SINGLE=single, FUSED_MERGE=fused,
        MERGE_BLOCK_S=triton.next_power_of_2(splits) if fused else 1, IEEE=q.dtype == torch.float32,
        INTERP=INTERPRETED, EARLY_V=cfg["EARLY_V"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch(cfg.get("pdl")))
    return m, l_part, acc


def _prefill(meta, cfg, *, q, cache, table, out, window, qk_scale):
    """The grid comes from the host copy of the ragged layout (prefill is never graph-captured)."""
    batch, max_pages = table.shape
    heads, hd = q.shape[1], q.shape[2]
    page, kv_heads = cache.shape[2], cache.shape[3]
    starts = meta.query_start_host
    longest = max(starts[i + 1] - starts[i] for i in range(batch))
    bm = cfg["PREFILL_BLOCK_M"]
    _prefill_kernel[(triton.cdiv(longest, bm), heads, batch)](
        q, cache, table, meta.seq_lens, meta.positions, meta.query_start, out, *strides(q, cache, table, out),
        max_pages, window or 0, qk_scale, hd,
        GROUP=heads // kv_heads, BLOCK_M=bm, BLOCK_N=cfg["PREFILL_BLOCK_N"],
        BLOCK_D=max(MIN_DOT, triton.next_power_of_2(hd)), PAGE=page, HAS_WINDOW=window is not None,
        IEEE=q.dtype == torch.float32, INTERP=INTERPRETED,
        num_warps=cfg["PREFILL_WARPS"], num_stages=cfg["PREFILL_STAGES"], **pdl_launch(cfg.get("pdl")))
