"""Weight-only FP8 GEMV on whole weight rows, read before the PDL wait: the `*:triton_fp8_rows` variants of
`qkvg_proj`, `attn_out` and `dense_mlp` at decode sizes (up to ROWS activation rows).

At batch-1 decode an FP8 projection of a TP8 rank is a few MB a launch (qkvg_proj ~9 MB, attn_out ~4 MB),
so a launch's fixed costs (its programs starting, a K loop's dependent loads, the tail) weigh as much as its
bytes. Each program here owns BLOCK_N output rows and loads them whole, with their scales, before it waits
on the kernel before it: weights are never written, so under PDL a launch's bytes stream while its
predecessor finishes, and all of a program's bytes are in flight at once (no K loop). K is loaded as a power
of two plus the power of two covering the rest (`moe_rows.pieces`: 5120 -> 4096 + 1024). Then, for each
activation row, the E4M3 values convert to FP32 in registers (the hardware's cvt from e4m3x2), the products
sum once a row in FP32, the row's scale multiplies the sum once and the result is rounded once to the model
dtype (`round_to`). Each output element is one program's fixed-order sum: bitwise identical run to run.

- `gate` (attn_out): the activation is attention's output gated on the way (`output_gate.gated_tile`, the
  reference's rounding), so the gated rows never go through memory and the gate takes no launch.
- `up` (dense_mlp's gate/up): the program reads the same rows of gate and up and stores SwiGLU, g and u
  rounded as the reference's GEMMs round them, silu(g) * u in FP32, rounded once.
Past ROWS activation rows (a prompt through a decode lock) the contract still holds: up to
`gemv_fp8.MAX_ROWS` rows through `gemv_fp8.fp8_linear`'s row tiles, more (where each row tile would read the
weights again) as the reference computes them, the weights dequantized into the model dtype for a cuBLAS GEMM.

The kernel is defined only where triton imports (the configs and `supports` import without it), after
TRITON_INTERPRET is set on the CPU.
"""

import torch

from beam_model.quant.tensors import Fp8Weight
from workbench.variants.kernels.fp8_decode import CONFIGS as TILED_CONFIGS
from workbench.variants.kernels.fp8_decode import decode_supports, fp8_weights
from workbench.variants.kernels.triton_common import pdl_launch, triton

ROWS = 8  # activation rows a launch serves holding its weight rows; a row more costs a pass over them in registers

# BLOCK_N whole weight rows a program (one config drives every launch of a variant); the first is the default
CONFIGS = [dict(BLOCK_N=2, num_warps=4), dict(BLOCK_N=1, num_warps=4), dict(BLOCK_N=4, num_warps=8),
           dict(BLOCK_N=1, num_warps=2)]
# attn_out's rows are short (a rank's heads x head_dim: 768 at beam-501b-tp8, against 5120 for the other
# projections), so its programs can hold more of them: fewer programs, each computing the gated row once
NARROW_CONFIGS = [dict(BLOCK_N=8, num_warps=2), dict(BLOCK_N=16, num_warps=4), dict(BLOCK_N=32, num_warps=8)]

if triton is not None:
    import triton.language as tl

    from workbench.variants.kernels.output_gate import gated_tile
    from workbench.variants.kernels.triton_common import pdl_enter, round_to

    @triton.jit
    def _rows(w_ptr, s_ptr, offs_n, stride_wn, stride_sn, N, K: tl.constexpr, K_A: tl.constexpr,
              K_B: tl.constexpr):
        """Weight rows `offs_n` whole, as pieces A and B of K, and their scales."""
        n_ok = offs_n < N
        rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
        ka = tl.arange(0, K_A)[None, :]
        kb = K_A + tl.arange(0, K_B)[None, :]
        return (tl.load(rows + ka, mask=n_ok[:, None], other=0.0),
                tl.load(rows + kb, mask=n_ok[:, None] & (kb < K), other=0.0),
                tl.load(s_ptr + offs_n * stride_sn, mask=n_ok, other=0.0))

    @triton.jit
    def _inputs(x_ptr, g_ptr, bias_ptr, m, k, M, K: tl.constexpr, stride_xm, stride_xh, stride_g,
                HD: tl.constexpr, GATED: tl.constexpr, DTYPE: tl.constexpr):
        """Activation row m at inputs k, [1, len(k)] in FP32: x's, or with GATED attention's output o gated
        by g (o [M, heads, HD] at strides stride_xm, stride_xh), rounded to DTYPE as the reference rounds it."""
        if GATED:
            a = gated_tile(x_ptr, g_ptr, bias_ptr, m, k, M, K, stride_xm, stride_xh, stride_g, HD, DTYPE)
        else:
            a = tl.load(x_ptr + m * stride_xm + k[None, :], mask=(k < K)[None, :], other=0.0)
        return a.to(tl.float32)

    @triton.jit
    def _dot(wa, wb, xa, xb, scale):
        """Each row's sum of products over both pieces, times its scale: [BLOCK_N] FP32."""
        return (tl.sum(wa.to(tl.float32) * xa, axis=1) + tl.sum(wb.to(tl.float32) * xb, axis=1)) * scale

    @triton.jit
    def fp8_rows_gemv_kernel(x_ptr, g_ptr, bias_ptr, w_ptr, s_ptr, w2_ptr, s2_ptr, y_ptr, N, stride_xm, stride_xh,
                             stride_g, stride_wn, stride_sn, M: tl.constexpr, K: tl.constexpr, K_A: tl.constexpr,
                             K_B: tl.constexpr, BLOCK_N: tl.constexpr, HD: tl.constexpr, GATED: tl.constexpr,
                             SWIGLU: tl.constexpr, PDL: tl.constexpr = False):
        """y [M, N] = (x @ w.T) * s.T for BLOCK_N rows of w a program (SWIGLU: silu of that times the same of
        w2, s2); w [N, K] E4M3, s [N] FP32. Grid (N tiles,)."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        # weights are never written: read whole before the wait, while the previous kernel finishes
        wa, wb, scale = _rows(w_ptr, s_ptr, offs_n, stride_wn, stride_sn, N, K, K_A, K_B)
        if SWIGLU:
            ua, ub, u_scale = _rows(w2_ptr, s2_ptr, offs_n, stride_wn, stride_sn, N, K, K_A, K_B)
        pdl_enter(PDL)  # the activations come from the previous kernel
        dtype = y_ptr.dtype.element_ty
        ka = tl.arange(0, K_A)
        kb = K_A + tl.arange(0, K_B)
        for m in tl.static_range(M):
            xa = _inputs(x_ptr, g_ptr, bias_ptr, m, ka, M, K, stride_xm, stride_xh, stride_g, HD, GATED, dtype)
            xb = _inputs(x_ptr, g_ptr, bias_ptr, m, kb, M, K, stride_xm, stride_xh, stride_g, HD, GATED, dtype)
            y = _dot(wa, wb, xa, xb, scale)
            if SWIGLU:
                g = round_to(y, dtype).to(tl.float32)
                u = round_to(_dot(ua, ub, xa, xb, u_scale), dtype).to(tl.float32)
                y = g / (1.0 + tl.exp(-g)) * u  # silu as torch computes it, in FP32
            tl.store(y_ptr + m * N + offs_n, round_to(y, dtype), mask=offs_n < N)


def supports(qualname: str):
    """The `supports` of a `*:triton_fp8_rows` variant: a GPU that loads E4M3, a float dtype, at most ROWS
    activation rows (past them `fp8_rows_linear` hands the rows on, see the module's docstring)."""
    return decode_supports(qualname, ROWS, "it holds its weight rows for them; more go to gemv_fp8's tiles or a "
                                           "dequantized GEMM")


def fp8_rows_linear(x: torch.Tensor, w: Fp8Weight, cfg: dict, *, up: Fp8Weight | None = None,
                    gate: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [M, K] @ dequantized(w).T in x's dtype at tuning config `cfg` (BLOCK_N, num_warps; optional pdl).
    With `up`: silu(x @ w.T) * (x @ up.T), w the gate. With `gate` = (g [M, K], bias [heads]): x is attention's
    output o [M, heads, head_dim], gated by g before the product. No host syncs: capturable in a CUDA graph."""
    from workbench.variants.kernels import gemv_fp8  # kernels: imported on use
    from workbench.variants.kernels.moe_rows import pieces

    w, second = fp8_weights(w, up, "the FP8 rows GEMV")
    m = x.shape[0]
    if m > ROWS:  # static shape dispatch: graph-safe
        if gate is not None:
            from workbench.variants.kernels.output_gate import output_gate

            x = output_gate(x, gate[0], gate[1], pdl=cfg.get("pdl", False))
        tiles = {**TILED_CONFIGS[0], **({"pdl": cfg["pdl"]} if "pdl" in cfg else {})}  # this config's PDL choice
        return gemv_fp8.fp8_linear(x, w, tiles, up=up)
    n, k = w.shape
    g, bias, hd = x, x, 1  # without a gate its pointers go unread
    if gate is not None:
        g, bias = gate
        hd = x.shape[-1]
        x = x if x.stride(-1) == 1 else x.contiguous()
        g = g if g.stride(-1) == 1 else g.contiguous()
    elif x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    k_a, k_b = pieces(k)
    fp8_rows_gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, g, bias, w.weight, w.scale, second.weight, second.scale, y, n, x.stride(0),
        x.stride(1) if gate is not None else 0, g.stride(0), w.weight.stride(0), w.scale.stride(0),
        M=m, K=k, K_A=k_a, K_B=k_b, BLOCK_N=cfg["BLOCK_N"], HD=hd, GATED=gate is not None, SWIGLU=up is not None,
        num_warps=cfg["num_warps"], num_stages=1, **pdl_launch(cfg.get("pdl")))
    return y
