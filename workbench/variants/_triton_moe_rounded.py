"""Triton kernels of `experts:triton_rounded` (see `experts__triton_rounded.py`): experts:triton's
grouped path with each routed pair's down projection rounded to the model dtype, as the reference
rounds each expert's output, and the routing weights applied in the combine.

experts:triton keeps every pair's row in FP32 until the combine: at a prefill of 8 x 2048 tokens,
top-8 of hidden 5120, that is 2.7 GB written and read back per layer. Rounded rows halve it, and
are the reference's own rounding. Few pairs (decode) take experts:triton's GEMV path, which has no
per-pair rows. Imported on the variant's first call (TRITON_INTERPRET must be set before).
"""

import torch
import triton
import triton.language as tl

from workbench.variants._triton_moe import (GEMV_MAX_PAIRS, _INTERPRETED, _dot, _gate_up_grouped, _round,
                                            align_by_expert, default_config, fused_experts)


@triton.jit
def _down_grouped_rounded(act_ptr, pairs_ptr, block_expert_ptr, wd_ptr, out_ptr,
                          N_PAIRS, N_EXPERTS, HIDDEN, FF, stride_we, stride_wh,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          N_BLOCKS_N: tl.constexpr, PRECISION: tl.constexpr, INTERP: tl.constexpr):
    """out[pair, n-block] = act[row] @ down[e].T rounded to the model dtype, for one expert's block."""
    pid_m = tl.program_id(0) // N_BLOCKS_N
    pid_n = tl.program_id(0) % N_BLOCKS_N
    e = tl.load(block_expert_ptr + pid_m)
    if e >= N_EXPERTS:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m)
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
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * HIDDEN + cols[None, :],
             _round(acc, out_ptr.dtype.element_ty, INTERP), mask=(pairs < N_PAIRS)[:, None] & (cols[None, :] < HIDDEN))


@triton.jit
def _combine_weighted(out_ptr, rw_ptr, y_ptr, HIDDEN, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                      INTERP: tl.constexpr):
    """y[token] = sum_k rw[token, k] * out[token * TOP_K + k] in FP32, in k order, rounded once."""
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < HIDDEN
    acc = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(TOP_K):
        rw = tl.load(rw_ptr + token * TOP_K + k)
        acc += rw * tl.load(out_ptr + (token * TOP_K + k) * HIDDEN + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + token * HIDDEN + offs, _round(acc, y_ptr.dtype.element_ty, INTERP), mask=ok)


def rounded_experts(x, ids, weights, w, config: dict | None = None):
    """The `experts` contract; `config` is a grouped tuning config of experts:triton (None: by size)."""
    n, top_k = ids.shape
    n_pairs = n * top_k
    if n_pairs <= GEMV_MAX_PAIRS:
        return fused_experts(x, ids, weights, w)  # decode: the GEMV path keeps no per-pair rows
    wg, wu, wd = w["gate_proj"], w["up_proj"], w["down_proj"]
    n_experts, ff, hidden = wg.shape
    if not (wg.stride(-1) == wu.stride(-1) == wd.stride(-1) == 1 and wg.stride() == wu.stride()):
        raise ValueError("experts:triton_rounded needs weights contiguous along their last dim, gate/up alike")
    cfg = config or default_config(n_pairs, n_experts)
    if cfg["path"] != "grouped":
        raise ValueError(f"experts:triton_rounded takes grouped configs, not {cfg}")
    x, ids, rw = x.contiguous(), ids.contiguous(), weights.contiguous().float()
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], INTERP=_INTERPRETED,
                  PRECISION="ieee" if x.dtype == torch.float32 else None)  # FP32 never drops to TF32
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    # experts:triton's grouping and gate/up kernel as they are; only the down projection and the
    # combine differ (the rows they pass between them are rounded)
    sorted_pairs, block_expert = align_by_expert(ids, n_experts, bm)
    n_blocks = block_expert.numel()
    act = torch.empty(n_blocks * bm, ff, dtype=x.dtype, device=x.device)
    grid_n = triton.cdiv(ff, bn)
    _gate_up_grouped[(n_blocks * grid_n,)](
        x, sorted_pairs, block_expert, wg, wu, act, n_pairs, n_experts, hidden, ff, wg.stride(0), wg.stride(1),
        TOP_K=top_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, N_BLOCKS_N=grid_n, **launch)
    out = torch.empty(n_pairs, hidden, dtype=x.dtype, device=x.device)
    grid_n = triton.cdiv(hidden, bn)
    _down_grouped_rounded[(n_blocks * grid_n,)](
        act, sorted_pairs, block_expert, wd, out, n_pairs, n_experts, hidden, ff, wd.stride(0), wd.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, N_BLOCKS_N=grid_n, **launch)
    y = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(hidden))
    _combine_weighted[(n, triton.cdiv(hidden, block))](out, rw, y, hidden, TOP_K=top_k, BLOCK=block,
                                                        INTERP=_INTERPRETED)
    return y
