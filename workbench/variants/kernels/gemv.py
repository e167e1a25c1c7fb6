"""Small-M linear layers in Triton, shared by `qkvg_proj` and `dense_mlp`.

At decode a projection multiplies 1-16 activation rows by megabytes of weights: the whole cost is
streaming the weight matrix once from HBM, so the kernel's job is to keep enough loads in flight
(many CTAs, wide loads, optional split-K) and to fuse what comes after the GEMM into its epilogue:
- packed outputs: rows of a packed weight ([q; k; v; gate]) are written segment-major into one
  buffer, so each output is a contiguous [M, width] tensor without a copy;
- SwiGLU: with a packed [gate; up] weight each program accumulates the same rows of gate and up and
  writes silu(g) * u computed in FP32, rounded once (g and u first rounded as the reference's GEMMs
  round them).
Two inner products, chosen per tuning config: FMA (broadcast multiply, FP32 accumulators, for M of
1-16) and `tl.dot` on tensor cores (M padded to BLOCK_M >= 16; also the tiled path for larger M).
Split-K is deterministic: partial sums go to an FP32 workspace and the last CTA of a tile (found
with an integer atomic counter) adds them in split order; no float atomics.

Never imported where triton is missing: the point modules import this module guarded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.variants.kernels.triton_common import INTERPRETED, pdl_enter, pdl_launch, round_to

# The interpreter's tl.dot multiplies 16-bit floats as raw bits, so interpreted dots take exact FP32
# operands; its truncating FP32 -> BF16 cast is handled by `round_to` (both: see triton_common).
LOCK_SLOTS = 4096  # split-K tile counters per prepared weight set; more tiles than this: no split-K


def new_locks(device) -> torch.Tensor:
    """Split-K tile counters (zero between calls: the last CTA of each tile resets its counter).
    Allocated at weight-prepare time, never inside a call, so a CUDA graph replays against them."""
    return torch.zeros(LOCK_SLOTS, dtype=torch.int32, device=device)


@triton.jit
def linear_kernel(x_ptr, w_ptr, out_ptr, part_ptr, lock_ptr, M, N, K, stride_xm, b1, b2, b3,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT_K: tl.constexpr, DOT: tl.constexpr, SWIGLU: tl.constexpr, IEEE: tl.constexpr,
                   PDL: tl.constexpr = False):
    """out = x @ w[:N].T (SWIGLU: silu(x @ w[:N].T) * (x @ w[N:2N].T)), x [M, K], w rows contiguous.

    Grid (N tiles, SPLIT_K, M tiles): one program streams BLOCK_N weight rows (2 x BLOCK_N with
    SWIGLU: the same rows of gate and up, so the activation needs no second pass) over its K split.
    """
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    k_span = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K  # each split covers whole K tiles
    offs_k = pid_k * k_span + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * K + offs_k[None, :]
    # FMA: products go into a [M, N, K] FP32 accumulator, reduced over K once after the loop, so
    # the loop body is only loads and FMAs. DOT: tensor cores, FP32 accumulator [M, N].
    if DOT:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), tl.float32)
    acc_u = acc_g  # the up rows' accumulator (dead code without SWIGLU)
    if PDL:  # weights are never written: the first tile is read while the previous kernel finishes
        w_first = tl.load(w_ptrs, mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)
        if SWIGLU:
            wu_first = tl.load(w_ptrs + N * K, mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)
    pdl_enter(PDL)
    for k0 in range(0, k_span, BLOCK_K):
        k_mask = (offs_k + k0 < K)[None, :]
        x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & k_mask, other=0.0)
        if PDL and k0 == 0:
            w = w_first
            if SWIGLU:
                wu = wu_first
        else:
            w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask, other=0.0)
            if SWIGLU:
                wu = tl.load(w_ptrs + N * K + k0, mask=n_mask[:, None] & k_mask, other=0.0)
        if not DOT:
            x = x.to(tl.float32)[:, None, :]
            acc_g += x * w.to(tl.float32)[None, :, :]
            if SWIGLU:
                acc_u += x * wu.to(tl.float32)[None, :, :]
        elif IEEE:  # FP32 stays FP32 (no TF32); 16-bit inputs go exactly through FP32 when interpreted
            acc_g = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc_g, input_precision="ieee")
            if SWIGLU:
                acc_u = tl.dot(x.to(tl.float32), tl.trans(wu.to(tl.float32)), acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(x, tl.trans(w), acc_g)
            if SWIGLU:
                acc_u = tl.dot(x, tl.trans(wu), acc_u)
    if not DOT:
        acc_g = tl.sum(acc_g, axis=2)
        acc_u = tl.sum(acc_u, axis=2)
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        # Deterministic split-K: every split writes its FP32 partial; the split that arrives last
        # (integer counter) sums all partials in split order, so the result never depends on timing.
        # The others run the same code with every load and store masked off.
        stride_p = N
        if SWIGLU:
            stride_p = 2 * N
        p_ptrs = part_ptr + (pid_k * M + offs_m[:, None]) * stride_p + offs_n[None, :]
        tl.store(p_ptrs, acc_g, mask=mask)
        if SWIGLU:
            tl.store(p_ptrs + N, acc_u, mask=mask)
        tl.debug_barrier()  # all threads' partials are written before the one-thread release below
        lock = lock_ptr + pid_m * tl.num_programs(0) + pid_n
        count = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
        # Only the last split loads and stores below (the test is built tile-shaped because the
        # interpreter mis-types `tensor & scalar`).
        mask = mask & (tl.full((BLOCK_M, BLOCK_N), SPLIT_K - 1, tl.int32) == count)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for s in range(SPLIT_K):  # a loop, not unrolled: SPLIT_K tiles of loads in flight spill
            p_ptrs = part_ptr + (s * M + offs_m[:, None]) * stride_p + offs_n[None, :]
            acc_g += tl.load(p_ptrs, mask=mask, other=0.0, cache_modifier=".cg")  # .cg: from L2, never L1
            if SWIGLU:
                acc_u += tl.load(p_ptrs + N, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(lock, 0, mask=count == SPLIT_K - 1)  # reset for the next launch (stream-ordered)
    if SWIGLU:
        # g and u rounded to the model dtype as the reference's GEMMs round them (the model gate
        # sees the difference), then silu as torch computes it, x / (1 + exp(-x)), in FP32.
        acc_g = round_to(acc_g, out_ptr.dtype.element_ty).to(tl.float32)
        acc_u = round_to(acc_u, out_ptr.dtype.element_ty).to(tl.float32)
        acc_g = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    # Segment-major store: column r of segment [start, end) goes to out[start*M + m*(end-start) +
    # r-start], so each segment is its own contiguous [M, end-start] block of one buffer.
    start = tl.where(offs_n >= b3, b3, tl.where(offs_n >= b2, b2, tl.where(offs_n >= b1, b1, 0)))
    end = tl.where(offs_n >= b3, N, tl.where(offs_n >= b2, b3, tl.where(offs_n >= b1, b2, b1)))
    out_ptrs = out_ptr + start[None, :] * M + offs_m[:, None] * (end - start)[None, :] + (offs_n - start)[None, :]
    tl.store(out_ptrs, round_to(acc_g, out_ptr.dtype.element_ty), mask=mask)


def linear(x: torch.Tensor, w: torch.Tensor, cfg: dict, locks: torch.Tensor | None = None, *,
           splits: tuple[int, ...] | None = None, swiglu: bool = False):
    """x [M, K] @ w.T with the tuning config `cfg` (keys: BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, DOT,
    num_warps, num_stages; optional pdl, see `pdl_launch`). `swiglu`: w is [gate; up] ([2N, K]) and
    the result silu(gate) * up [M, N]. `splits`: output column widths; returns one contiguous
    [M, width] tensor per split (views of one buffer). No host syncs: capturable in a CUDA graph."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = w.shape[0] // 2 if swiglu else w.shape[0]
    block_m, block_k = cfg["BLOCK_M"], cfg["BLOCK_K"]
    if not cfg["DOT"]:
        # FMA path: BLOCK_M shrinks to M; the K tile shrinks as it grows, keeping the [M, N, K]
        # accumulator (registers per thread) the size the config was tuned for at M = 1.
        block_m = min(block_m, triton.next_power_of_2(m))
        block_k = max(16, block_k // block_m)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), cfg["SPLIT_K"], triton.cdiv(m, block_m))
    split_k = cfg["SPLIT_K"] if locks is not None and grid[0] * grid[2] <= locks.numel() else 1
    grid = (grid[0], split_k, grid[2])
    out = torch.empty(m * n, dtype=x.dtype, device=x.device)
    part = torch.empty((split_k, m, 2 * n if swiglu else n), dtype=torch.float32, device=x.device) \
        if split_k > 1 else out
    bounds = [n] * 3
    if splits:
        assert sum(splits) == n and len(splits) <= 4, (splits, n)
        bounds = [min(sum(splits[:i]), n) if i < len(splits) else n for i in (1, 2, 3)]
    linear_kernel[grid](x, w, out, part, locks if split_k > 1 else out, m, n, k, x.stride(0), *bounds,
                         BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k, SPLIT_K=split_k,
                         DOT=cfg["DOT"], SWIGLU=swiglu, IEEE=x.dtype == torch.float32 or INTERPRETED,
                         num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch(cfg.get("pdl")))
    if not splits:
        return out.view(m, n)
    return tuple(out[m * b:m * (b + s)].view(m, s) for b, s in zip([0, *bounds], splits))


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, FF, stride_row, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """SwiGLU activation between GEMMs: gu [N, 2*ff] (gate half, then up half, as one packed GEMM
    makes them) -> silu(g) * u [N, ff] in FP32, rounded once. Replaces silu, mul and their FP32
    temporaries (five kernels' traffic) with one read of gu and one write."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < FF
    g = tl.load(gu_ptr + row * stride_row + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_row + FF + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * FF + offs, round_to(g / (1.0 + tl.exp(-g)) * u, out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gu: torch.Tensor, cfg: dict) -> torch.Tensor:
    """gu [N, 2*ff] -> silu(gu[:, :ff]) * gu[:, ff:] [N, ff]. `cfg`: BLOCK, num_warps, optional pdl."""
    n, ff = gu.shape[0], gu.shape[1] // 2
    out = torch.empty((n, ff), dtype=gu.dtype, device=gu.device)
    _silu_mul_kernel[(n, triton.cdiv(ff, cfg["BLOCK"]))](gu, out, ff, gu.stride(0), BLOCK=cfg["BLOCK"],
                                                         num_warps=cfg["num_warps"], **pdl_launch(cfg.get("pdl")))
    return out
