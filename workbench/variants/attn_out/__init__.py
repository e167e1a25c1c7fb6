"""`attn_out`: output gate, then the output projection.

Contract: `attn_out(o, g, w) -> y`; o [N, heads, hd] attention output, g [N, heads*hd] gate
projection, w {"gate_bias": [heads], "o_proj": [hidden, heads*hd]}. out_h = o_h * sigmoid(g_h + b_h)
(bias broadcast over the head's channels) in FP32, rounded once, then o_proj: y [N, hidden]
(a partial sum per rank under tensor parallelism).
"""

import torch
import torch.nn.functional as F

from workbench.points import Call, PointSpec, declare
from workbench.registry import register
from workbench.variants.inputs import DTYPE_BYTES, Rand


@register("attn_out", "torch", "torch")
def attn_out(o, g, w):
    n, heads, hd = o.shape
    gate = torch.sigmoid(g.float().view(n, heads, hd) + w["gate_bias"].float()[None, :, None])
    gated = (o.float() * gate).to(o.dtype).reshape(n, heads * hd)
    return F.linear(gated, w["o_proj"])


# ---- spec: inputs, roofline and tolerance for the harness ------------------------------------------


def _inputs(wl, device, seed):
    c, r = wl.config, Rand("attn_out", wl, device, seed)
    n = wl.tokens
    w = {"gate_bias": r.normal(c.num_attention_heads), "o_proj": r.linear(c.hidden_size, c.q_width)}
    return Call((r.normal(n, c.num_attention_heads, c.head_dim), r.normal(n, c.q_width), w), weights_arg=2)


def _bytes(wl):
    c = wl.config
    return DTYPE_BYTES[wl.dtype] * (2 * wl.tokens * c.q_width + c.num_attention_heads
                                    + c.hidden_size * c.q_width + wl.tokens * c.hidden_size)


declare(PointSpec(
    "attn_out", _inputs, bytes=_bytes,
    flops=lambda wl: 2 * wl.tokens * wl.config.q_width * wl.config.hidden_size + 4 * wl.tokens * wl.config.q_width,
    tolerance={"fp32": 1e-5, "fp16": 1e-3, "bf16": 8e-3},  # ~2.5x the reference's worst vs FP64
))


# ---- Triton: the gate as one elementwise kernel, or fused into a small-M GEMV ---------------------
# Kernels are defined only when triton imports; the variants are registered either way and the
# registry reports the backend as unavailable.
import functools

from workbench.variants.kernels.triton_common import INTERPRETED, pdl_launch, triton

if triton is not None:
    import triton.language as tl

    from workbench.variants.kernels.triton_common import pdl_enter, round_to

    @triton.jit
    def _gate(o, g, bias):
        """o * sigmoid(g + bias) in FP32, sigmoid as 1 / (1 + exp(-x)) and rounded apart, like torch."""
        return o.to(tl.float32) * (1.0 / (1.0 + tl.exp(-(g.to(tl.float32) + bias.to(tl.float32)))))

    @triton.jit
    def _attn_gate_kernel(o_ptr, g_ptr, bias_ptr, out_ptr, o_stride_n, o_stride_h, g_stride, width,
                          HD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """The output gate of BLOCK channels of one token, rounded once to the model dtype: the whole
        elementwise chain (add, sigmoid, mul, round) in one read of o and g and one write."""
        pdl_enter(PDL)
        n = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = c < width
        o = tl.load(o_ptr + n * o_stride_n + (c // HD) * o_stride_h + c % HD, mask=mask)
        g = tl.load(g_ptr + n * g_stride + c, mask=mask)
        b = tl.load(bias_ptr + c // HD, mask=mask)
        tl.store(out_ptr + n * width + c, round_to(_gate(o, g, b), out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gated_a(o_ptr, g_ptr, bias_ptr, m, k, n_tokens, width, o_stride_n, o_stride_h, g_stride,
                 HD: tl.constexpr, DTYPE: tl.constexpr):
        """The gated activations of tokens m, channels k, rounded to DTYPE (a GEMV step's A tile)."""
        a_mask = (m < n_tokens) & (k[None, :] < width)
        o = tl.load(o_ptr + m * o_stride_n + (k[None, :] // HD) * o_stride_h + k[None, :] % HD, mask=a_mask)
        g = tl.load(g_ptr + m * g_stride + k[None, :], mask=a_mask)
        b = tl.load(bias_ptr + k[None, :] // HD, mask=k[None, :] < width)
        return round_to(_gate(o, g, b), DTYPE)

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
            a = _gated_a(o_ptr, g_ptr, bias_ptr, m, k, n_tokens, width, o_stride_n, o_stride_h, g_stride,
                         HD, w_ptr.dtype.element_ty)
            acc = _gated_dot(a, tl.trans(w_first), acc, IEEE, UPCAST)
            k_start = BLOCK_K
        for k0 in range(k_start, width, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            a = _gated_a(o_ptr, g_ptr, bias_ptr, m, k, n_tokens, width, o_stride_n, o_stride_h, g_stride,
                         HD, w_ptr.dtype.element_ty)
            wt = tl.trans(tl.load(w_ptr + cols[:, None] * w_stride + k[None, :],
                                  mask=(cols[:, None] < hidden) & (k[None, :] < width), other=0.0))
            acc = _gated_dot(a, wt, acc, IEEE, UPCAST)
        tl.store(y_ptr + m * hidden + cols[None, :], round_to(acc, y_ptr.dtype.element_ty),
                 mask=(m < n_tokens) & (cols[None, :] < hidden))


_ATTN_GATE_CONFIGS = [{"BLOCK": 1024, "num_warps": 4}, {"BLOCK": 256, "num_warps": 2},
                      {"BLOCK": 512, "num_warps": 4}, {"BLOCK": 2048, "num_warps": 8}]
_GATED_GEMV_MAX_TOKENS = 16  # one 16-row dot tile; above it the GEMM is cuBLAS's job
_GATED_GEMV_CONFIGS = [{"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
                       {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3},
                       {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
                       {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 8, "num_stages": 2},
                       {"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 2, "num_stages": 4}]


def _attn_gate(o, g, bias, *, BLOCK=1024, num_warps=4, pdl=False):
    """gated [N, heads*hd] in the model dtype (the Triton gate kernel alone). `pdl`: see `pdl_launch`."""
    n, heads, hd = o.shape
    width = heads * hd
    o = o if o.stride(-1) == 1 else o.contiguous()
    g = g if g.stride(-1) == 1 else g.contiguous()
    out = torch.empty((n, width), dtype=o.dtype, device=o.device)
    if n:
        _attn_gate_kernel[(n, triton.cdiv(width, BLOCK))](o, g, bias, out, o.stride(0), o.stride(1), g.stride(0),
                                                           width, HD=hd, BLOCK=BLOCK, num_warps=num_warps,
                                                           **pdl_launch(pdl))
    return out


def _attn_out_triton_at(o, g, w, **cfg):
    return F.linear(_attn_gate(o, g, w["gate_bias"], **cfg), w["o_proj"])


def _attn_out_fused_at(o, g, w, *, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=3, pdl=False):
    n, heads, hd = o.shape
    if n > _GATED_GEMV_MAX_TOKENS:  # static shape dispatch (graph-safe): large batches keep cuBLAS
        return _attn_out_triton_at(o, g, w, **_ATTN_GATE_CONFIGS[0], pdl=pdl)
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


def _attn_out_triton_supports(workload):
    if workload.dtype not in ("bf16", "fp16", "fp32"):
        return f"dtype {workload.dtype} not handled (bf16, fp16, fp32)"
    return True


@register("attn_out", "triton", "triton", supports=_attn_out_triton_supports, configs=_ATTN_GATE_CONFIGS,
          pdl=True, configure=lambda cfg: functools.partial(_attn_out_triton_at, **cfg))
def attn_out_triton(o, g, w):
    """Triton gate kernel (one pass, rounded once), then o_proj with F.linear."""
    return _attn_out_triton_at(o, g, w, **_ATTN_GATE_CONFIGS[0])


@register("attn_out", "triton_fused", "triton", supports=_attn_out_triton_supports, configs=_GATED_GEMV_CONFIGS,
          pdl=True, configure=lambda cfg: functools.partial(_attn_out_fused_at, **cfg))
def attn_out_triton_fused(o, g, w):
    """Up to 16 tokens: one kernel, the gate fused into the o_proj GEMV. More tokens: the `triton`
    variant (gate kernel + cuBLAS), so a lock chosen at decode still serves prefill."""
    return _attn_out_fused_at(o, g, w, **_GATED_GEMV_CONFIGS[0])
