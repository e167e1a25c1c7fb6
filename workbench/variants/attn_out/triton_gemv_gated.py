"""`attn_out:triton_gemv_gated`: one kernel for 1-16 rows, the small-M FMA GEMV of
`attn_out:triton_gemv` (FP32 accumulators, the first o_proj tile read before the PDL wait) with the
output gate as its prologue: the gated activations never go to memory and the gate kernel's launch
goes. `attn_out:triton_fused` does the same on tensor cores (tl.dot on 16-row tiles); this is the FMA
form. Every program recomputes the gate of the rows' q_width channels (6 x 128 at TP8) from o and g,
which are in L2. More rows: `attn_out:triton` (gate kernel + cuBLAS)."""

import torch

from workbench.registry import register
from workbench.variants.kernels.output_gate import GATE_CONFIGS, GATED_GEMV_MAX_TOKENS, gated_linear, supports
from workbench.variants.kernels.triton_common import pdl_launch, triton

if triton is not None:
    import triton.language as tl

    from workbench.variants.kernels.output_gate import gated_tile
    from workbench.variants.kernels.triton_common import pdl_enter, round_to

    @triton.jit
    def _gated_gemv_fma(o_ptr, g_ptr, bias_ptr, w_ptr, y_ptr, n_tokens, width, hidden,
                        o_stride_n, o_stride_h, g_stride, HD: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
        """y[:, cols] = gate(o, g) @ o_proj[cols]^T: each program streams BLOCK_N o_proj rows once,
        multiplying them into a [BLOCK_M, BLOCK_N, BLOCK_K] FP32 tile reduced once at the end; the gated
        activations (rounded to the model dtype, as the reference rounds them before o_proj) are its A."""
        m = tl.arange(0, BLOCK_M)[:, None]
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + cols[:, None] * width + k[None, :]
        col_ok = cols[:, None] < hidden
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), tl.float32)
        if PDL:  # o_proj is never written: its first tile is read while the previous kernel finishes
            w_first = tl.load(w_ptrs, mask=col_ok & (k[None, :] < width), other=0.0)
        pdl_enter(PDL)
        for k0 in range(0, width, BLOCK_K):
            a = gated_tile(o_ptr, g_ptr, bias_ptr, m, k0 + k, n_tokens, width, o_stride_n, o_stride_h, g_stride,
                           HD, w_ptr.dtype.element_ty)
            if PDL and k0 == 0:
                w = w_first
            else:
                w = tl.load(w_ptrs + k0, mask=col_ok & (k0 + k[None, :] < width), other=0.0)
            acc += a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        y = round_to(tl.sum(acc, axis=2), y_ptr.dtype.element_ty)
        tl.store(y_ptr + m * hidden + cols[None, :], y, mask=(m < n_tokens) & (cols[None, :] < hidden))


# BLOCK_N o_proj rows x BLOCK_K channels per step at one row; like `kernels/gemv.linear`, more rows
# shrink BLOCK_K so the FP32 tile (registers per thread) stays the size tuned at one row. The 4 x 256
# tile is attn_out:triton_gemv's fastest at decode b1 (docs/variants.md).
CONFIGS = [dict(BLOCK_N=4, BLOCK_K=256, num_warps=4), dict(BLOCK_N=2, BLOCK_K=256, num_warps=2),
           dict(BLOCK_N=4, BLOCK_K=128, num_warps=4), dict(BLOCK_N=8, BLOCK_K=256, num_warps=4),
           dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4)]


def _gemv_gated_at(o, g, w, *, BLOCK_N, BLOCK_K, num_warps, pdl=False):
    n, heads, hd = o.shape
    if not 0 < n <= GATED_GEMV_MAX_TOKENS:  # static shape dispatch (graph-safe)
        return gated_linear(o, g, w, **GATE_CONFIGS[0], pdl=pdl)
    o_proj = w["o_proj"].contiguous()  # the kernel steps its rows by q_width (a no-op when contiguous)
    o = o if o.stride(-1) == 1 else o.contiguous()
    g = g if g.stride(-1) == 1 else g.contiguous()
    hidden = o_proj.shape[0]
    block_m = triton.next_power_of_2(n)
    y = torch.empty((n, hidden), dtype=o.dtype, device=o.device)
    _gated_gemv_fma[(triton.cdiv(hidden, BLOCK_N),)](
        o, g, w["gate_bias"], o_proj, y, n, heads * hd, hidden, o.stride(0), o.stride(1), g.stride(0),
        HD=hd, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=max(16, BLOCK_K // block_m),
        num_warps=num_warps, num_stages=1, **pdl_launch(pdl))
    return y


@register("attn_out", "triton_gemv_gated", "triton", supports=supports, configs=CONFIGS,
          pdl=True, configure=lambda cfg: lambda o, g, w: _gemv_gated_at(o, g, w, **cfg))
def attn_out_triton_gemv_gated(o, g, w):
    return _gemv_gated_at(o, g, w, **CONFIGS[0])
