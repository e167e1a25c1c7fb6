"""`attn_out:triton_fused`: up to 16 tokens, one kernel: the output gate as the prologue of an o_proj
GEMV on tensor cores (tl.dot on 16-row tiles), so the gated activations never go to memory. More
tokens: attn_out:triton's gate kernel and cuBLAS, so a lock chosen at decode still serves prefill.

Kernels are defined only when triton imports; the variant is registered either way and the registry
reports the backend as unavailable.
"""

import functools

import torch

from workbench.registry import register
from workbench.variants.kernels.output_gate import GATE_CONFIGS, GATED_GEMV_MAX_TOKENS, gated_linear, supports
from workbench.variants.kernels.triton_common import INTERPRETED, pdl_launch, triton

if triton is not None:
    import triton.language as tl

    from workbench.variants.kernels.output_gate import gated_tile
    from workbench.variants.kernels.triton_common import pdl_enter, round_to

    @triton.jit
    def _gated_dot(a, wt, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
        """acc + a @ wt at the model's precision (a GEMV step's dot)."""
        if UPCAST:  # the interpreter's dot multiplies BF16 operands as raw bits; BF16 products are exact in FP32
            return tl.dot(a.to(tl.float32), wt.to(tl.float32), acc, input_precision="ieee")
        elif IEEE:  # FP32 models: no TF32, like F.linear's default
            return tl.dot(a, wt, acc, input_precision="ieee")
        else:
            return tl.dot(a, wt, acc)

    @triton.jit
    def _gated_gemv_kernel(o_ptr, g_ptr, bias_ptr, w_ptr, y_ptr, n_tokens, width, hidden,
                           o_stride_n, o_stride_h, g_stride, w_stride,
                           HD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                           UPCAST: tl.constexpr, PDL: tl.constexpr = False):
        """y[:, cols] = gate(o, g) @ o_proj[cols]^T for up to 16 tokens: the gate is the GEMV's prologue,
        so the gated activations never go to memory. Each program owns BLOCK_N output features and
        streams their o_proj rows once; the (tiny) gate is recomputed per program, rounded to the model
        dtype before the dot exactly as the reference rounds it before o_proj."""
        m = tl.arange(0, 16)[:, None]
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        k_start = 0
        if PDL:  # o_proj is never written: its first tile is read while the previous kernel finishes
            k = tl.arange(0, BLOCK_K)
            w_first = tl.load(w_ptr + cols[:, None] * w_stride + k[None, :],
                              mask=(cols[:, None] < hidden) & (k[None, :] < width), other=0.0)
        pdl_enter(PDL)
        if PDL:  # its step is peeled off the loop: a load under an `if` in the loop is not pipelined
            a = gated_tile(o_ptr, g_ptr, bias_ptr, m, k, n_tokens, width, o_stride_n, o_stride_h, g_stride,
                           HD, w_ptr.dtype.element_ty)
            acc = _gated_dot(a, tl.trans(w_first), acc, IEEE, UPCAST)
            k_start = BLOCK_K
        for k0 in range(k_start, width, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            a = gated_tile(o_ptr, g_ptr, bias_ptr, m, k, n_tokens, width, o_stride_n, o_stride_h, g_stride,
                           HD, w_ptr.dtype.element_ty)
            wt = tl.trans(tl.load(w_ptr + cols[:, None] * w_stride + k[None, :],
                                  mask=(cols[:, None] < hidden) & (k[None, :] < width), other=0.0))
            acc = _gated_dot(a, wt, acc, IEEE, UPCAST)
        tl.store(y_ptr + m * hidden + cols[None, :], round_to(acc, y_ptr.dtype.element_ty),
                 mask=(m < n_tokens) & (cols[None, :] < hidden))


CONFIGS = [{"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
           {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3},
           {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
           {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 8, "num_stages": 2},
           {"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 2, "num_stages": 4}]


def _fused_at(o, g, w, *, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=3, pdl=False):
    n, heads, hd = o.shape
    if n > GATED_GEMV_MAX_TOKENS:  # static shape dispatch (graph-safe): large batches keep cuBLAS
        return gated_linear(o, g, w, **GATE_CONFIGS[0], pdl=pdl)
    o_proj = w["o_proj"]
    o_proj = o_proj if o_proj.stride(-1) == 1 else o_proj.contiguous()
    o = o if o.stride(-1) == 1 else o.contiguous()
    g = g if g.stride(-1) == 1 else g.contiguous()
    hidden = o_proj.shape[0]
    y = torch.empty((n, hidden), dtype=o.dtype, device=o.device)
    if n:
        _gated_gemv_kernel[(triton.cdiv(hidden, BLOCK_N),)](
            o, g, w["gate_bias"], o_proj, y, n, heads * hd, hidden, o.stride(0), o.stride(1), g.stride(0),
            o_proj.stride(0), HD=hd, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=o.dtype == torch.float32,
            UPCAST=INTERPRETED and o.dtype == torch.bfloat16,
            num_warps=num_warps, num_stages=num_stages, **pdl_launch(pdl))
    return y


@register("attn_out", "triton_fused", "triton", supports=supports, configs=CONFIGS,
          pdl=True, configure=lambda cfg: functools.partial(_fused_at, **cfg))
def attn_out_triton_fused(o, g, w):
    """Up to 16 tokens: one kernel, the gate fused into the o_proj GEMV. More tokens: the `triton`
    variant (gate kernel + cuBLAS), so a lock chosen at decode still serves prefill."""
    return _fused_at(o, g, w, **CONFIGS[0])
