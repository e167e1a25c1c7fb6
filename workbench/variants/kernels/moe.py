"""Triton kernels of the fused MoE of `experts:triton` and `experts:triton_rounded` (the contract is in
`workbench/variants/experts/__init__.py`), and the pieces other experts variants reuse: the SwiGLU
store (`swiglu_store`), the grouping by expert (`align_by_expert`), the grouped gate/up
(`grouped_gate_up`), the combine (`combine`), the weight check (`checked_weights`). Imported on a
variant's first call, never when a variant module is imported, so the point imports without triton
and TRITON_INTERPRET can still be set before these kernels are defined.

Two paths compute the same function, each with two kernels:
- GEMV (few routed pairs, decode): one program per (token, k) pair x a block of ff rows computes
  gate, up and SwiGLU with FP32 FMAs; then one program per token x a block of hidden rows runs the
  down projection over all top_k experts, applies the routing weights and combines in FP32. Only
  the selected experts' weights are read, streamed once with wide loads; no sorting, no scratch
  beyond the activation.
- grouped (many pairs, prefill): routed pairs are sorted by expert into blocks of BLOCK_M padded per
  expert (vLLM's `moe_align_block_size`, here two small Triton kernels: no host sync, so it is
  CUDA-graph capturable; the grid is sized for the worst case and surplus blocks exit at once).
  Kernel 1 is a grouped gate+up GEMM (tl.dot, FP32 accumulation) with SwiGLU in the epilogue;
  kernel 2 the grouped down GEMM with the routing weight in the epilogue, writing each pair's FP32
  row; a small kernel sums each token's top_k rows in a fixed order and rounds once. Rounded
  (experts:triton_rounded): kernel 2 writes each pair's row rounded to the model dtype, as the
  reference rounds an expert's output, and the combine applies the weights (half the bytes between
  them: 2.7 GB a layer in FP32 at 8 x 2048 tokens, top-8 of hidden 5120).

A "pdl" config launches every kernel with programmatic dependent launch (`triton_common.pdl_launch`);
each waits at its top, since even its weights depend on the routed ids an earlier kernel wrote.

Atomics only count arrivals (the GEMV path's SPLIT_K configs), never sum values: every output element
is written by one program, in a fixed order, so results are bitwise identical run to run. The
activation is rounded once to the model dtype (as in the reference); the combine is FP32 and rounded
once.
"""

import os

import torch
import triton
import triton.language as tl

from workbench.variants.kernels.arrivals import arrival_counters
from workbench.variants.kernels.triton_common import pdl_enter, pdl_launch, round_to

GEMV_MAX_PAIRS = 64      # auto path: GEMV up to this many (token, k) pairs (decode up to b8 at top_k 8)
GEMV_HARD_MAX_PAIRS = 2048  # a forced GEMV config re-reads an expert per pair; past this, always group

# Defaults when no tuning config is given; each is also in `experts/triton.py`'s CONFIGS (a test checks).
GEMV = dict(path="gemv", BLOCK_N=8, BLOCK_K=512, DOWN_BLOCK_N=16, DOWN_BLOCK_K=64, num_warps=4, num_stages=1)
GROUPED_SMALL = dict(path="grouped", BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
GROUPED_LARGE = dict(path="grouped", BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)


# The CPU interpreter mishandles bf16 in two ways these kernels meet: `tl.dot` multiplies the raw
# bits (triton-lang/triton#11584) and FP32 -> bf16 casts truncate. Under it (only), dots upcast to
# FP32 (exact for bf16/fp16) and `round_to` rounds to nearest even by hand, as the GPU cast does.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def default_config(n_pairs: int, n_experts: int) -> dict:
    if n_pairs <= GEMV_MAX_PAIRS:
        return GEMV
    # vLLM's rule of thumb: with few rows per expert a tall BLOCK_M is mostly padding
    return GROUPED_SMALL if n_pairs <= 4 * n_experts else GROUPED_LARGE


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, INTERP: tl.constexpr):
    if INTERP:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


# ---- GEMV path -----------------------------------------------------------------------------------

@triton.jit
def gate_up_gemv_kernel(x_ptr, ids_ptr, wg_ptr, wu_ptr, act_ptr, part_ptr, count_ptr, HIDDEN, FF, K_PER_SPLIT,
                        stride_we, stride_wf, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT: tl.constexpr, PDL: tl.constexpr = False):
    """act[pair, n-block] = silu(x[token] @ gate[e].T) * (x[token] @ up[e].T), e = ids[pair].

    Fuses both GEMVs and SwiGLU: each gate/up weight element is loaded once (BLOCK_K-wide rows
    along hidden, which is contiguous) and FMA'd into an FP32 tile that is reduced only at the end,
    so the inner loop is pure loads + FMAs. Only the pair's own expert is touched.
    SPLIT > 1: hidden is cut into SPLIT slices (program_id 2), more programs streaming at once; each
    stores its FP32 partial (gate, up) and the last of a (pair, n-block) to arrive (an arrival
    counter, `arrivals.py`) sums them in slice order, applies SwiGLU and resets the counter.
    """
    pdl_enter(PDL)
    pair = tl.program_id(0)
    token = pair // TOP_K
    e = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_off = e * stride_we + offs_n[:, None] * stride_wf + offs_k[None, :]
    k_lo = tl.program_id(2) * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, HIDDEN)
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = offs_k + k0 < k_hi
        xk = tl.load(x_ptr + token.to(tl.int64) * HIDDEN + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        m = (offs_n[:, None] < FF) & k_ok[None, :]  # rows past FF would be the next expert's: never read
        acc_g += tl.load(wg_ptr + w_off + k0, mask=m, other=0.0).to(tl.float32) * xk[None, :]
        acc_u += tl.load(wu_ptr + w_off + k0, mask=m, other=0.0).to(tl.float32) * xk[None, :]
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    n_ok = offs_n < FF
    if SPLIT > 1:
        rows = part_ptr + (pair.to(tl.int64) * SPLIT * 2) * FF + offs_n  # part[pair, slice, gate|up, FF]
        tl.store(rows + (tl.program_id(2) * 2) * FF, g, mask=n_ok)
        tl.store(rows + (tl.program_id(2) * 2 + 1) * FF, u, mask=n_ok)
        tl.debug_barrier()  # every thread's stores before the count moves (a release)
        counter = count_ptr + pair * tl.num_programs(1) + tl.program_id(1)
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT - 1:
            g = tl.zeros([BLOCK_N], tl.float32)
            u = tl.zeros([BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT):  # slice order: bitwise reproducible
                g += tl.load(rows + (s * 2) * FF, mask=n_ok, other=0.0, cache_modifier=".cg")
                u += tl.load(rows + (s * 2 + 1) * FF, mask=n_ok, other=0.0, cache_modifier=".cg")
            swiglu_store(g, u, act_ptr + pair.to(tl.int64) * FF + offs_n, n_ok)
            tl.atomic_xchg(counter, 0)
    else:
        swiglu_store(g, u, act_ptr + pair.to(tl.int64) * FF + offs_n, n_ok)


@triton.jit
def swiglu(g, u):
    """silu(g) * u in FP32 (tl.sigmoid inlined: cheaper interpreted)."""
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def swiglu_store(g, u, act_ptrs, mask):
    tl.store(act_ptrs, round_to(swiglu(g, u), act_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def down_gemv_kernel(act_ptr, ids_ptr, rw_ptr, wd_ptr, y_ptr, HIDDEN, FF, stride_we, stride_wh,
                     TOP_K: tl.constexpr, K_P2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PDL: tl.constexpr = False):
    """y[token, n-block] = sum_k rw[token, k] * (act[token, k] @ down[ids[token, k]].T), rounded once.

    One program owns its output rows across all top_k experts, so the weighted combine happens in
    FP32 registers in a fixed order: no per-pair scratch, no atomics, deterministic. Each step loads
    one [top_k, BLOCK_N, BLOCK_K] tile (all experts at once: top_k independent wide loads in
    flight, which ff = 320 alone could not give); the routing weight scales the activation.
    """
    pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_f = tl.arange(0, BLOCK_K)
    slot = tl.arange(0, K_P2)
    slot_ok = slot < TOP_K
    pairs = token * TOP_K + slot
    e = tl.load(ids_ptr + pairs, mask=slot_ok, other=0).to(tl.int64)
    rw = tl.load(rw_ptr + pairs, mask=slot_ok, other=0.0)
    a_ptrs = act_ptr + pairs[:, None] * FF + offs_f[None, :]
    w_ptrs = wd_ptr + e[:, None, None] * stride_we + offs_n[None, :, None] * stride_wh + offs_f[None, None, :]
    w_ok = slot_ok[:, None, None] & (offs_n < HIDDEN)[None, :, None]
    acc = tl.zeros([K_P2, BLOCK_N, BLOCK_K], tl.float32)
    for f0 in range(0, FF, BLOCK_K):
        f_ok = offs_f + f0 < FF
        a = tl.load(a_ptrs + f0, mask=slot_ok[:, None] & f_ok[None, :], other=0.0).to(tl.float32) * rw[:, None]
        wd = tl.load(w_ptrs + f0, mask=w_ok & f_ok[None, None, :], other=0.0)
        acc += wd.to(tl.float32) * a[:, None, :]
    y = round_to(tl.sum(tl.sum(acc, axis=2), axis=0), y_ptr.dtype.element_ty)
    tl.store(y_ptr + token * HIDDEN + offs_n, y, mask=offs_n < HIDDEN)


# ---- grouped path --------------------------------------------------------------------------------

ALIGN_CHUNK = 512  # routed pairs per program of the grouping kernels
ALIGN_SUB = 32     # of them compared with every expert at once when counting ([ALIGN_SUB, experts])
# of them placed at once, compared with each other: at 128 the [128, 128] tiles took 255 registers and
# spilled (sm_90, 8 warps), and align ran no faster than the scans it replaced; 32 takes 56
ALIGN_PLACE = 32
ALIGN_ROWS = 16    # chunks' counts read at once
MARK = 64          # block marks written at once


@triton.jit
def count_by_expert_kernel(ids_ptr, chunk_counts_ptr, N_PAIRS, E_P2: tl.constexpr, CHUNK: tl.constexpr,
                           SUB: tl.constexpr, PDL: tl.constexpr = False):
    """chunk_counts[c, e] = how many of chunk c's routed pairs go to expert e. One program per CHUNK
    pairs, each id read once and compared with every expert: no atomics, no host-side bincount."""
    pdl_enter(PDL)
    c = tl.program_id(0)
    experts = tl.arange(0, E_P2)
    n = tl.zeros([E_P2], tl.int32)
    for s0 in range(0, CHUNK, SUB):
        offs = c * CHUNK + s0 + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + offs, mask=offs < N_PAIRS, other=-1)
        n += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(chunk_counts_ptr + c * E_P2 + experts, n)


@triton.jit
def align_by_expert_kernel(ids_ptr, chunk_counts_ptr, cursor_ptr, pairs_ptr, block_expert_ptr, N_PAIRS, N_EXPERTS,
                           N_CHUNKS, MAX_BLOCKS, E_P2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                           PLACE: tl.constexpr, ROWS: tl.constexpr, MARK_N: tl.constexpr, PDL: tl.constexpr = False):
    """vLLM's `moe_align_block_size` over chunks: expert e's pair ids, in pair order, fill its run of
    pairs[], padded to a multiple of BLOCK_M with the sentinel N_PAIRS, and its blocks are marked e in
    block_expert[]. A chunk's pairs go to its experts' runs after those of the chunks before it (the
    counts of `count_by_expert_kernel`), each after the same expert's pairs before it in the chunk (this
    program's next free slot per expert lives in cursor[c, :]), so every slot is written by one
    program, in the order a stable sort by expert gives. Program c also pads and marks experts c,
    c + N_CHUNKS, ...; the last marks the worst-case grid's surplus blocks N_EXPERTS (skip)."""
    pdl_enter(PDL)
    c = tl.program_id(0)
    experts = tl.arange(0, E_P2)
    total = tl.zeros([E_P2], tl.int32)
    before = tl.zeros([E_P2], tl.int32)
    for r0 in range(0, N_CHUNKS, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        counts = tl.load(chunk_counts_ptr + rows[:, None] * E_P2 + experts[None, :], mask=(rows < N_CHUNKS)[:, None],
                         other=0)
        total += tl.sum(counts, axis=0)
        before += tl.sum(tl.where((rows < c)[:, None], counts, 0), axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.cumsum(padded, axis=0) - padded
    cursor = cursor_ptr + c * E_P2
    tl.store(cursor + experts, start + before)
    i = tl.arange(0, PLACE)
    for s0 in range(0, CHUNK, PLACE):
        tl.debug_barrier()  # the cursors the last round moved are visible to every thread
        offs = c * CHUNK + s0 + i
        ok = offs < N_PAIRS
        ids = tl.load(ids_ptr + offs, mask=ok, other=-1)
        same = ids[:, None] == ids[None, :]
        earlier = tl.sum((same & (i[None, :] < i[:, None])).to(tl.int32), axis=1)
        later = tl.sum((same & (i[None, :] > i[:, None])).to(tl.int32), axis=1)
        slot = tl.load(cursor + ids, mask=ok, other=0) + earlier
        tl.store(pairs_ptr + slot, offs, mask=ok)
        tl.debug_barrier()  # every thread has read the cursors before one moves
        tl.store(cursor + ids, slot + 1, mask=ok & (later == 0))  # each expert's last pair here moves it
    for e in range(c, N_EXPERTS, N_CHUNKS):
        first = tl.sum(tl.where(experts == e, start, 0))
        filled = first + tl.sum(tl.where(experts == e, total, 0))
        end = first + tl.sum(tl.where(experts == e, padded, 0))
        pad = filled + tl.arange(0, BLOCK_M)
        tl.store(pairs_ptr + pad, tl.full([BLOCK_M], N_PAIRS, tl.int32), mask=pad < end)
        for b0 in range(first // BLOCK_M, end // BLOCK_M, MARK_N):
            b = b0 + tl.arange(0, MARK_N)
            tl.store(block_expert_ptr + b, tl.full([MARK_N], 0, tl.int32) + e, mask=b < end // BLOCK_M)
    if c == N_CHUNKS - 1:
        for b0 in range(tl.sum(padded) // BLOCK_M, MAX_BLOCKS, MARK_N):
            b = b0 + tl.arange(0, MARK_N)
            tl.store(block_expert_ptr + b, tl.full([MARK_N], N_EXPERTS, tl.int32), mask=b < MAX_BLOCKS)


def align_by_expert(ids: torch.Tensor, n_experts: int, block_m: int, pdl: bool = False):
    """Routed pairs grouped by expert, on the device with no host sync (CUDA-graph capturable):
    sorted_pairs [max_blocks * block_m] int32 (pair = token * top_k + k; padding = n_pairs) and
    block_expert [max_blocks] int32 (n_experts past the end). max_blocks is the worst case for
    this many pairs, so every shape depends only on ids' shape."""
    n_pairs = ids.numel()
    max_blocks = triton.cdiv(n_pairs + min(n_experts, n_pairs) * (block_m - 1), block_m)
    n_chunks, e_p2 = triton.cdiv(n_pairs, ALIGN_CHUNK), triton.next_power_of_2(n_experts)
    chunk_counts = torch.empty((n_chunks, e_p2), dtype=torch.int32, device=ids.device)
    cursors = torch.empty_like(chunk_counts)
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=ids.device)
    sizes = dict(E_P2=e_p2, CHUNK=ALIGN_CHUNK, num_warps=8)
    count_by_expert_kernel[(n_chunks,)](ids, chunk_counts, n_pairs, SUB=ALIGN_SUB, **sizes, **pdl_launch(pdl))
    align_by_expert_kernel[(n_chunks,)](ids, chunk_counts, cursors, sorted_pairs, block_expert, n_pairs, n_experts,
                                        n_chunks, max_blocks, BLOCK_M=block_m, PLACE=ALIGN_PLACE, ROWS=ALIGN_ROWS,
                                        MARK_N=MARK, **sizes, **pdl_launch(pdl))
    return sorted_pairs, block_expert


@triton.jit
def gate_up_grouped_kernel(x_ptr, pairs_ptr, block_expert_ptr, wg_ptr, wu_ptr, act_ptr,
                           N_PAIRS, N_EXPERTS, HIDDEN, FF, stride_we, stride_wf,
                           TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           N_BLOCKS_N: tl.constexpr, PRECISION: tl.constexpr, INTERP: tl.constexpr,
                           PDL: tl.constexpr = False):
    """act[block rows, n-block] = silu(X_e @ gate[e].T) * (X_e @ up[e].T) for one expert's block of
    BLOCK_M routed rows (X_e gathered from x by token). Fuses the two GEMMs (same A tile, two
    tensor-core dots into FP32 accumulators) and SwiGLU in the epilogue, so gate and up never reach
    memory. act rows are written at their sorted position, where kernel 2 reads them contiguously.
    """
    pdl_enter(PDL)
    # n fastest: the N_BLOCKS_N programs of one row block run together and share its x rows in L2
    pid_m = tl.program_id(0) // N_BLOCKS_N
    pid_n = tl.program_id(0) % N_BLOCKS_N
    e = tl.load(block_expert_ptr + pid_m)
    if e >= N_EXPERTS:  # a worst-case block nobody needed
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m)
    tokens = tl.where(pairs < N_PAIRS, pairs // TOP_K, 0)  # padding rows read token 0, never stored
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % FF  # wrap, so weight loads stay in expert e
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens.to(tl.int64)[:, None] * HIDDEN + offs_k[None, :]
    w_off = e.to(tl.int64) * stride_we + offs_n[None, :] * stride_wf + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        k_ok = offs_k + k0 < HIDDEN
        a = tl.load(x_ptrs + k0, mask=k_ok[None, :], other=0.0)
        bg = tl.load(wg_ptr + w_off + k0, mask=k_ok[:, None], other=0.0)
        bu = tl.load(wu_ptr + w_off + k0, mask=k_ok[:, None], other=0.0)
        acc_g = _dot(a, bg, acc_g, PRECISION, INTERP)
        acc_u = _dot(a, bu, acc_u, PRECISION, INTERP)
    act = round_to(swiglu(acc_g, acc_u), act_ptr.dtype.element_ty)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(act_ptr + offs_m.to(tl.int64)[:, None] * FF + cols[None, :], act, mask=cols[None, :] < FF)


@triton.jit
def down_grouped_kernel(act_ptr, pairs_ptr, block_expert_ptr, rw_ptr, wd_ptr, out_ptr,
                        N_PAIRS, N_EXPERTS, HIDDEN, FF, stride_we, stride_wh,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        N_BLOCKS_N: tl.constexpr, ROUNDED: tl.constexpr, PRECISION: tl.constexpr,
                        INTERP: tl.constexpr, PDL: tl.constexpr = False):
    """out[pair, n-block] = act[row] @ down[e].T for one expert's block of rows: times the routing
    weight in FP32, or (ROUNDED) rounded to the model dtype with the weight left to the combine.

    Rows of one token land in different programs, so instead of atomics each pair gets its own row
    (scattered back to pair order) and `_combine` sums them: deterministic, rounded once.
    """
    pdl_enter(PDL)
    pid_m = tl.program_id(0) // N_BLOCKS_N
    pid_n = tl.program_id(0) % N_BLOCKS_N
    e = tl.load(block_expert_ptr + pid_m)
    if e >= N_EXPERTS:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m)
    row_ok = pairs < N_PAIRS
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % HIDDEN
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + offs_m.to(tl.int64)[:, None] * FF + offs_k[None, :]
    w_off = e.to(tl.int64) * stride_we + offs_n[None, :] * stride_wh + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for f0 in range(0, FF, BLOCK_K):
        f_ok = offs_k + f0 < FF
        a = tl.load(a_ptrs + f0, mask=f_ok[None, :], other=0.0)
        b = tl.load(wd_ptr + w_off + f0, mask=f_ok[:, None], other=0.0)
        acc = _dot(a, b, acc, PRECISION, INTERP)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if ROUNDED:
        rows = round_to(acc, out_ptr.dtype.element_ty)
    else:
        rows = acc * tl.load(rw_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * HIDDEN + cols[None, :], rows,
             mask=row_ok[:, None] & (cols[None, :] < HIDDEN))


@triton.jit
def _combine(out_ptr, rw_ptr, y_ptr, pos_ptr, HIDDEN, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
             WEIGHTED: tl.constexpr, SORTED: tl.constexpr = False, PDL: tl.constexpr = False):
    """y[token] = sum_k out[row of (token, k)] (times rw[token, k] when WEIGHTED) in FP32, in k order,
    rounded once to the model dtype. The row of pair p = token * TOP_K + k is p, or pos[p] when
    SORTED (`out` holds the pairs in another order, e.g. sorted by expert)."""
    pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < HIDDEN
    acc = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(TOP_K):
        pair = token * TOP_K + k
        if SORTED:
            pair = tl.load(pos_ptr + pair).to(tl.int64)
        row = tl.load(out_ptr + pair * HIDDEN + offs, mask=ok, other=0.0).to(tl.float32)
        if WEIGHTED:
            row = tl.load(rw_ptr + token * TOP_K + k) * row
        acc += row
    tl.store(y_ptr + token * HIDDEN + offs, round_to(acc, y_ptr.dtype.element_ty), mask=ok)


def combine(out: torch.Tensor, weights: torch.Tensor, top_k: int, *, weighted: bool, dtype: torch.dtype,
            pos: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """`_combine` over every token: y [tokens, hidden] in `dtype`."""
    n, hidden = (out.shape[0] if pos is None else pos.numel()) // top_k, out.shape[1]
    y = torch.empty(n, hidden, dtype=dtype, device=out.device)
    block = min(1024, triton.next_power_of_2(hidden))
    _combine[(n, triton.cdiv(hidden, block))](out, weights, y, out if pos is None else pos, hidden, TOP_K=top_k,
                                              BLOCK=block, WEIGHTED=weighted, SORTED=pos is not None,
                                              **pdl_launch(pdl))
    return y


# ---- entry points ----------------------------------------------------------------------------------

def checked_weights(w: dict, variant: str, *, down: bool = True):
    """(gate, up, down) as the kernels read them: contiguous along their last dim, gate and up with one
    set of strides (the kernels take one); `down=False`: another library reads down."""
    wg, wu, wd = w["gate_proj"], w["up_proj"], w["down_proj"]
    if not (wg.stride(-1) == wu.stride(-1) == 1 and wg.stride() == wu.stride() and (not down or wd.stride(-1) == 1)):
        raise ValueError(f"{variant} needs weights contiguous along their last dim, gate/up alike")
    return wg, wu, wd


def grouped_gate_up(x, ids, wg, wu, *, block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int,
                    pdl: bool = False):
    """The grouped path's first half: the routed pairs grouped by expert in tiles of `block_m` rows
    (`align_by_expert`), then gate/up + SwiGLU into those rows (`gate_up_grouped_kernel`). Returns
    (sorted_pairs, block_expert, act [tiles x block_m, ff] in the model dtype)."""
    n_experts, ff, hidden = wg.shape
    sorted_pairs, block_expert = align_by_expert(ids, n_experts, block_m, pdl)
    n_blocks = block_expert.numel()
    act = torch.empty(n_blocks * block_m, ff, dtype=x.dtype, device=x.device)
    grid_n = triton.cdiv(ff, block_n)
    # FP32 weights (CPU tests, FP32 builds) must not silently drop to TF32 on the tensor cores
    gate_up_grouped_kernel[(n_blocks * grid_n,)](
        x, sorted_pairs, block_expert, wg, wu, act, ids.numel(), n_experts, hidden, ff, wg.stride(0), wg.stride(1),
        TOP_K=ids.shape[1], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, N_BLOCKS_N=grid_n,
        PRECISION="ieee" if x.dtype == torch.float32 else None, INTERP=_INTERPRETED, num_warps=num_warps,
        num_stages=num_stages, **pdl_launch(pdl))
    return sorted_pairs, block_expert, act


def fused_experts(x, ids, weights, w, config: dict | None = None, *, rounded: bool = False):
    """The `experts` contract. `config` is one of the variant's tuning configs; its "path" forces
    GEMV or grouped (the harness times both at the target's batch); without one, the path and tile
    are picked by size (a config of only {"pdl": True} keeps that). `rounded`
    (experts:triton_rounded): the grouped path rounds each pair's down projection to the model dtype,
    as the reference rounds each expert's output, and weights the pairs in the combine."""
    wg, wu, wd = checked_weights(w, "experts:triton")
    n, top_k = ids.shape
    n_experts, ff, hidden = wg.shape
    x, ids, rw = x.contiguous(), ids.contiguous(), weights.contiguous().float()
    y = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    n_pairs = n * top_k
    if n_pairs == 0:
        return y
    cfg = config if config and "path" in config else {**default_config(n_pairs, n_experts), **(config or {})}
    if cfg["path"] == "gemv" and n_pairs > GEMV_HARD_MAX_PAIRS:
        cfg = {**default_config(n_pairs, n_experts), "pdl": cfg.get("pdl", False)}
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch(cfg.get("pdl")))

    if cfg["path"] == "gemv":
        act = torch.empty(n_pairs, ff, dtype=x.dtype, device=x.device)
        bn, bk = cfg["BLOCK_N"], min(cfg["BLOCK_K"], triton.next_power_of_2(hidden))
        # hidden slices of whole BLOCK_K steps, none empty
        steps = triton.cdiv(hidden, bk)
        per = triton.cdiv(steps, min(cfg.get("SPLIT_K", 1), steps))
        split = triton.cdiv(steps, per)
        grid = (n_pairs, triton.cdiv(ff, bn), split)
        part = torch.empty((n_pairs, split, 2, ff), dtype=torch.float32, device=x.device) if split > 1 else act
        count = arrival_counters(grid[0] * grid[1], x.device, "experts") if split > 1 else act
        gate_up_gemv_kernel[grid](
            x, ids, wg, wu, act, part, count, hidden, ff, per * bk, wg.stride(0), wg.stride(1),
            TOP_K=top_k, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, **launch)
        bn, bk = cfg["DOWN_BLOCK_N"], min(cfg["DOWN_BLOCK_K"], triton.next_power_of_2(ff))
        down_gemv_kernel[(n, triton.cdiv(hidden, bn))](
            act, ids, rw, wd, y, hidden, ff, wd.stride(0), wd.stride(1),
            TOP_K=top_k, K_P2=triton.next_power_of_2(top_k), BLOCK_N=bn, BLOCK_K=bk,
            **{**launch, "num_warps": cfg.get("DOWN_WARPS", cfg["num_warps"])})
        return y

    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    sorted_pairs, block_expert, act = grouped_gate_up(
        x, ids, wg, wu, block_m=bm, block_n=bn, block_k=bk, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        pdl=cfg.get("pdl", False))
    n_blocks = block_expert.numel()
    launch.update(PRECISION="ieee" if x.dtype == torch.float32 else None, INTERP=_INTERPRETED)
    # per-pair rows: FP32 and weighted, or (rounded) in the model dtype: half the bytes to the combine
    out = torch.empty(n_pairs, hidden, dtype=x.dtype if rounded else torch.float32, device=x.device)
    # the down GEMM (N = hidden, K = ff) may take its own tile, warps and stages: it has one
    # accumulator where gate/up has two, and a short reduction (ff) where gate/up's is hidden
    bn, bk = cfg.get("DOWN_BLOCK_N", bn), cfg.get("DOWN_BLOCK_K", bk)
    grid_n = triton.cdiv(hidden, bn)
    down_grouped_kernel[(n_blocks * grid_n,)](
        act, sorted_pairs, block_expert, rw, wd, out, n_pairs, n_experts, hidden, ff, wd.stride(0), wd.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, N_BLOCKS_N=grid_n, ROUNDED=rounded,
        **{**launch, "num_warps": cfg.get("DOWN_WARPS", cfg["num_warps"]),
           "num_stages": cfg.get("DOWN_STAGES", cfg["num_stages"])})
    return combine(out, rw, top_k, weighted=rounded, dtype=x.dtype, pdl=cfg.get("pdl", False))
