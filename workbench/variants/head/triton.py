"""`head:triton`: the final RMSNorm in one Triton kernel, then the LM head with the soft-cap in its
epilogue; two launches.

`_head_norm` (FP32 RMSNorm rounded to the model dtype, as the reference), then the LM head with the
soft-cap (`kernels/softcap.py`) applied to the accumulator before the only store of the logits:
  N <= gemv_max_tokens  `_head_gemv`: split-N GEMV, each program streams BLOCK_V vocab rows once
                        for all tokens (batch 1 at TP8 reads a 168 MB weight: bandwidth-bound);
  larger N              `_head_mm`: tiled tl.dot (tensor cores for BF16/FP16, IEEE FP32 FMAs for
                        FP32), tiles over M varying fastest so a weight tile is shared from L2.
The epilogue rounds the FP32 accumulator to the model dtype first, exactly as the reference's
GEMM output is rounded before its FP32 soft-cap, so results match up to summation order.

Imports without triton (`triton_common.jit` leaves plain functions): the variant is registered either
way and the registry reports the backend as unavailable.
"""

import os

import torch

from workbench.registry import register
from workbench.variants.kernels.softcap import tanh_softcap
from workbench.variants.kernels.triton_common import jit as _jit
from workbench.variants.kernels.triton_common import pdl_enter, pdl_launch, pow2, tl, triton


@_jit
def _rounded(x, DTYPE: tl.constexpr):
    """FP32 x rounded to the model dtype DTYPE, returned as FP32. BF16 rounds to nearest even on the
    bits: what the GPU's conversion does, spelt out because the Triton interpreter truncates."""
    if DTYPE == tl.bfloat16:
        b = x.to(tl.int32, bitcast=True)
        return ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)


@_jit
def _head_norm(h_ptr, w_ptr, x_ptr, H, eps, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    """Final RMSNorm of one row: FP32 as `rms_norm` ((h * rsqrt(mean(h^2) + eps)) * w), rounded to
    the model dtype, which is what the reference feeds its GEMM."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for k0 in range(0, H, BLOCK_H):
        o = k0 + tl.arange(0, BLOCK_H)
        v = tl.load(h_ptr + row * H + o, mask=o < H, other=0.0).to(tl.float32)
        acc += v * v
    r = tl.rsqrt(tl.sum(acc, axis=0) / H + eps)
    for k0 in range(0, H, BLOCK_H):
        o = k0 + tl.arange(0, BLOCK_H)
        v = tl.load(h_ptr + row * H + o, mask=o < H, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + o, mask=o < H, other=0.0).to(tl.float32)
        y = _rounded(v * r * wv, x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * H + o, y.to(x_ptr.dtype.element_ty), mask=o < H)


@_jit
def _head_gemv(x_ptr, w_ptr, out_ptr, N, V, K, cap,
               BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """logits[n, v] = softcap(round(x[n] . W[v])) for a few tokens: a program owns BLOCK_V vocab rows
    and reads them once for all N tokens. Products accumulate element-wise in a [N, V, K] register
    tile, reduced over K once at the end (the loop is loads + FMAs only)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_v = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    acc = tl.zeros((BLOCK_N, BLOCK_V, BLOCK_K), tl.float32)
    if PDL:  # the LM head is never written: its first tile is read while the norm kernel finishes
        offs_k = tl.arange(0, BLOCK_K)
        w_first = tl.load(w_ptr + offs_v[:, None] * K + offs_k[None, :],
                          mask=(offs_v[:, None] < V) & (offs_k < K)[None, :], other=0.0)
    pdl_enter(PDL)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < K
        if PDL and k0 == 0:
            w = w_first.to(tl.float32)
        else:
            w = tl.load(w_ptr + offs_v[:, None] * K + offs_k[None, :],
                        mask=(offs_v[:, None] < V) & in_k[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs_n[:, None] * K + offs_k[None, :],
                    mask=(offs_n[:, None] < N) & in_k[None, :], other=0.0).to(tl.float32)
        acc += x[:, None, :] * w[None, :, :]
    z = _rounded(tl.sum(acc, axis=2), x_ptr.dtype.element_ty)  # the reference's GEMM rounding
    tl.store(out_ptr + offs_n[:, None] * V + offs_v[None, :], tanh_softcap(z, cap),
             mask=(offs_n[:, None] < N) & (offs_v[None, :] < V))


@_jit
def _head_mm(x_ptr, w_ptr, out_ptr, N, V, K, cap,
             BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
             DOT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False):
    """logits tile = softcap(round(x @ W^T)), soft-cap on the FP32 accumulator in the epilogue.
    IEEE: FP32 model, tl.dot in IEEE FP32 (as torch without TF32). Otherwise tensor cores in DOT,
    the model dtype (tl.float32 under the interpreter, whose BF16 tl.dot multiplies raw bits; BF16
    products are exact in FP32 either way)."""
    pdl_enter(PDL)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    acc = tl.zeros((BLOCK_M, BLOCK_V), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < K
        a = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :],
                    mask=(offs_m[:, None] < N) & in_k[None, :], other=0.0)
        b = tl.load(w_ptr + offs_v[None, :] * K + offs_k[:, None],  # W^T tile [BLOCK_K, BLOCK_V]
                    mask=(offs_v[None, :] < V) & in_k[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a.to(DOT), b.to(DOT), acc)
    z = _rounded(acc, x_ptr.dtype.element_ty)  # the reference's GEMM rounding
    tl.store(out_ptr + offs_m[:, None] * V + offs_v[None, :], tanh_softcap(z, cap),
             mask=(offs_m[:, None] < N) & (offs_v[None, :] < V))


def _dot_dtype(dtype):
    if os.environ.get("TRITON_INTERPRET") == "1" and dtype == torch.bfloat16:
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(dtype, tl.float32)


CONFIGS = [
    # gemv_max_tokens: N up to which the GEMV runs (else tl.dot tiles; 0 = always tiles).
    dict(gemv_max_tokens=4, gemv_block_v=32, gemv_block_k=256, gemv_warps=4,
         mm_block_m=64, mm_block_v=128, mm_block_k=64, mm_warps=4, mm_stages=4),
    dict(gemv_max_tokens=1, gemv_block_v=16, gemv_block_k=512, gemv_warps=4,
         mm_block_m=64, mm_block_v=64, mm_block_k=128, mm_warps=4, mm_stages=3),
    dict(gemv_max_tokens=8, gemv_block_v=64, gemv_block_k=128, gemv_warps=8,
         mm_block_m=128, mm_block_v=128, mm_block_k=64, mm_warps=8, mm_stages=3),
    dict(gemv_max_tokens=0, gemv_block_v=32, gemv_block_k=256, gemv_warps=4,
         mm_block_m=32, mm_block_v=64, mm_block_k=128, mm_warps=4, mm_stages=4),
]


def _head_triton_at(cfg):
    def head_triton(h, w, *, eps, softcap):
        h, weight = h.contiguous(), w["lm_head"].contiguous()
        n, k = h.shape
        v = weight.shape[0]
        out = torch.empty((n, v), dtype=torch.float32, device=h.device)
        if n == 0:
            return out
        x = torch.empty_like(h)
        pdl = pdl_launch(cfg.get("pdl"))
        _head_norm[(n,)](h, w["norm"], x, k, float(eps), BLOCK_H=min(pow2(k), 8192), num_warps=8, **pdl)
        if n <= cfg["gemv_max_tokens"]:
            bn = pow2(n)
            bk = max(16, cfg["gemv_block_k"] // bn)  # the register tile stays BLOCK_V x gemv_block_k
            _head_gemv[(triton.cdiv(v, cfg["gemv_block_v"]),)](
                x, weight, out, n, v, k, float(softcap), BLOCK_N=bn, BLOCK_V=cfg["gemv_block_v"], BLOCK_K=bk,
                num_warps=cfg["gemv_warps"], **pdl)
        else:
            bm = min(cfg["mm_block_m"], max(16, pow2(n)))
            _head_mm[(triton.cdiv(n, bm), triton.cdiv(v, cfg["mm_block_v"]))](
                x, weight, out, n, v, k, float(softcap), BLOCK_M=bm, BLOCK_V=cfg["mm_block_v"],
                BLOCK_K=cfg["mm_block_k"], DOT=_dot_dtype(weight.dtype), IEEE=weight.dtype == torch.float32,
                num_warps=cfg["mm_warps"], num_stages=cfg["mm_stages"], **pdl)
        return out

    return head_triton


def _supports(wl):
    c = wl.config
    if wl.dtype not in ("bf16", "fp16", "fp32"):
        return f"head:triton takes bf16/fp16/fp32, not {wl.dtype}"
    if c.vocab_size * c.hidden_size >= 2 ** 31 or wl.tokens * c.vocab_size >= 2 ** 31:
        return "head:triton indexes with int32: vocab x hidden and tokens x vocab must stay below 2^31"
    return True


register("head", "triton", "triton", supports=_supports, configs=CONFIGS, pdl=True,
         configure=_head_triton_at)(_head_triton_at(CONFIGS[0]))
