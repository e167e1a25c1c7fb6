"""Grouped GEMM kernels of `experts:triton_fp8_grouped`: experts:triton's grouped path (`moe.py`: routed pairs
sorted by expert into blocks of BLOCK_M rows, a gate/up GEMM with SwiGLU in its epilogue, a down GEMM into
per-pair rows, a combine in FP32 rounded once) on FP8 expert weights with FP8 activations (W8A8): both GEMMs
run on FP8 tensor cores (twice BF16's rate on Hopper), the weights read as stored, their inputs in E4M3:
- x quantized per token (`fp8_rows.quantize_rows`, one launch); the gate/up accumulators take each row's
  token scale and each channel's weight scale;
- the activation (in the model dtype, as the reference's) quantized per row the same way, the blocks' padding
  rows skipped; the down accumulator takes each row's scale, each channel's weight scale and the routing
  weight.
The weights are exact and the activations rounded to E4M3, held to the point's FP8-activation tolerance.

Imported on the variant's first call, so the point imports without triton and TRITON_INTERPRET can be set
before these kernels are defined.
"""

import torch
import triton
import triton.language as tl

from workbench.variants.kernels.fp8_rows import quantize_rows
from workbench.variants.kernels.moe import _INTERPRETED, _dot, align_by_expert, combine, swiglu
from workbench.variants.kernels.moe_quantized import checked_weights
from workbench.variants.kernels.triton_common import pdl_enter, pdl_launch, round_to


@triton.jit
def _channel_scale(s_ptr, e, offs_n, n_ok, stride_se, stride_sn):
    """The FP8 weight scales of output channels `offs_n` of expert e: [BLOCK_N]."""
    return tl.load(s_ptr + e * stride_se + offs_n * stride_sn, mask=n_ok, other=0.0)


@triton.jit
def gate_up_fp8_kernel(xq_ptr, xs_ptr, pairs_ptr, block_expert_ptr, wg_ptr, wu_ptr, sg_ptr, su_ptr, act_ptr,
                       N_PAIRS, N_EXPERTS, HIDDEN, FF, stride_we, stride_wf, stride_se, stride_sf,
                       TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       N_BLOCKS_N: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr = False):
    """act[block rows, n-block] = silu(X_e @ gate[e].T) * (X_e @ up[e].T) for one expert's block of BLOCK_M
    routed rows, X_e the rows' E4M3 tokens: FP8 dots, each row's token scale and each channel's weight scale on
    the FP32 accumulators."""
    pdl_enter(PDL)
    pid_m = tl.program_id(0) // N_BLOCKS_N
    pid_n = tl.program_id(0) % N_BLOCKS_N
    e = tl.load(block_expert_ptr + pid_m)
    if e >= N_EXPERTS:  # a worst-case block nobody needed
        return
    e = e.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m)
    tokens = tl.where(pairs < N_PAIRS, pairs // TOP_K, 0)  # padding rows read token 0, never stored
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < FF
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = xq_ptr + tokens.to(tl.int64)[:, None] * HIDDEN + offs_k[None, :]
    w_rows = e * stride_we + offs_n[:, None].to(tl.int64) * stride_wf + offs_k[None, :]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        k_ok = (offs_k + k0 < HIDDEN)[None, :]
        a = tl.load(x_ptrs + k0, mask=k_ok, other=0.0)
        bg = tl.load(wg_ptr + w_rows + k0, mask=n_ok[:, None] & k_ok, other=0.0)
        bu = tl.load(wu_ptr + w_rows + k0, mask=n_ok[:, None] & k_ok, other=0.0)
        acc_g = _dot(a, tl.trans(bg), acc_g, None, INTERP)
        acc_u = _dot(a, tl.trans(bu), acc_u, None, INTERP)
    row_scale = tl.load(xs_ptr + tokens)[:, None]
    g = acc_g * row_scale * _channel_scale(sg_ptr, e, offs_n, n_ok, stride_se, stride_sf)[None, :]
    u = acc_u * row_scale * _channel_scale(su_ptr, e, offs_n, n_ok, stride_se, stride_sf)[None, :]
    act = round_to(swiglu(g, u), act_ptr.dtype.element_ty)
    tl.store(act_ptr + offs_m.to(tl.int64)[:, None] * FF + offs_n[None, :], act, mask=n_ok[None, :])


@triton.jit
def down_fp8_kernel(aq_ptr, as_ptr, pairs_ptr, block_expert_ptr, rw_ptr, wd_ptr, sd_ptr, out_ptr, N_PAIRS,
                    N_EXPERTS, HIDDEN, FF, stride_we, stride_wh, stride_se, stride_sh, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, N_BLOCKS_N: tl.constexpr, INTERP: tl.constexpr,
                    PDL: tl.constexpr = False):
    """out[pair, n-block] = rw[pair] * (act[row] @ down[e].T) in FP32 for one expert's block of rows, the rows'
    E4M3 activations by FP8 dots, each pair its own row (scattered back to pair order) for `moe.combine`."""
    pdl_enter(PDL)
    pid_m = tl.program_id(0) // N_BLOCKS_N
    pid_n = tl.program_id(0) % N_BLOCKS_N
    e = tl.load(block_expert_ptr + pid_m)
    if e >= N_EXPERTS:
        return
    e = e.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m)
    row_ok = pairs < N_PAIRS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < HIDDEN
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = aq_ptr + offs_m.to(tl.int64)[:, None] * FF + offs_k[None, :]
    w_rows = e * stride_we + offs_n[:, None].to(tl.int64) * stride_wh + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for f0 in range(0, FF, BLOCK_K):
        k_ok = (offs_k + f0 < FF)[None, :]
        a = tl.load(a_ptrs + f0, mask=k_ok, other=0.0)
        b = tl.load(wd_ptr + w_rows + f0, mask=n_ok[:, None] & k_ok, other=0.0)
        acc = _dot(a, tl.trans(b), acc, None, INTERP)
    row_scale = tl.load(as_ptr + offs_m) * tl.load(rw_ptr + pairs, mask=row_ok, other=0.0)
    rows = acc * row_scale[:, None] * _channel_scale(sd_ptr, e, offs_n, n_ok, stride_se, stride_sh)[None, :]
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * HIDDEN + offs_n[None, :], rows,
             mask=row_ok[:, None] & n_ok[None, :])


# ---- entry point -----------------------------------------------------------------------------------

def fp8_grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: dict,
                        cfg: dict) -> torch.Tensor:
    """The `experts` contract on FP8 expert weights with E4M3 activations, at one of the variant's tuning
    configs."""
    fmt, (wg, sg, _), (wu, su, _), (wd, sd, _) = checked_weights(w, "experts:triton_fp8_grouped")
    if fmt != "fp8":
        raise ValueError(f"experts:triton_fp8_grouped reads FP8 expert weights, got {fmt}")
    n, top_k = ids.shape
    n_experts, ff, hidden = wg.shape[0], wg.shape[1], x.shape[1]
    ids, rw = ids.contiguous(), weights.contiguous().float()
    n_pairs = n * top_k
    if n_pairs == 0:
        return torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    pdl = cfg.get("pdl", False)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    xq, xs = quantize_rows(x.contiguous())
    sorted_pairs, block_expert = align_by_expert(ids, n_experts, bm, pdl)
    n_blocks = block_expert.numel()
    act = torch.empty(n_blocks * bm, ff, dtype=x.dtype, device=x.device)
    common = dict(INTERP=_INTERPRETED, **pdl_launch(pdl))
    grid_n = triton.cdiv(ff, bn)
    gate_up_fp8_kernel[(n_blocks * grid_n,)](
        xq, xs, sorted_pairs, block_expert, wg, wu, sg, su, act, n_pairs, n_experts, hidden, ff, wg.stride(0),
        wg.stride(1), sg.stride(0), sg.stride(1), TOP_K=top_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, N_BLOCKS_N=grid_n,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **common)
    aq, a_scale = quantize_rows(act, used=(sorted_pairs, n_pairs))
    out = torch.empty(n_pairs, hidden, dtype=torch.float32, device=x.device)
    bn, bk = cfg.get("DOWN_BLOCK_N", bn), cfg.get("DOWN_BLOCK_K", bk)
    grid_n = triton.cdiv(hidden, bn)
    down_fp8_kernel[(n_blocks * grid_n,)](
        aq, a_scale, sorted_pairs, block_expert, rw, wd, sd, out, n_pairs, n_experts, hidden, ff, wd.stride(0),
        wd.stride(1), sd.stride(0), sd.stride(1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, N_BLOCKS_N=grid_n,
        num_warps=cfg.get("DOWN_WARPS", cfg["num_warps"]), num_stages=cfg.get("DOWN_STAGES", cfg["num_stages"]),
        **common)
    return combine(out, rw, top_k, weighted=False, dtype=x.dtype, pdl=pdl)
