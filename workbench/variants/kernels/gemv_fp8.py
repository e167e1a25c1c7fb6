"""Weight-only FP8 GEMV for decode sizes, shared by the `qkvg_proj`, `dense_mlp` and `attn_out` FP8 variants.

y[n, o] = (sum_i x[n, i] * float(w[o, i])) * scale[o] on an `Fp8Weight` (`beam_model/quant/tensors.py`: E4M3
values [out, in], one FP32 scale an output row). The E4M3 bytes are read as stored and converted to FP32 in
registers, so a decode step moves one byte a weight and never a dequantized copy; x stays in the model dtype,
products accumulate in FP32 and the row's scale multiplies the row's sum once, after the loop; the result is
rounded once to the model dtype (`round_to`, so the interpreter rounds as the GPU does).

One program owns BLOCK_N output rows for up to MAX_ROWS activation rows, so each weight byte is read once a
launch at decode. Products go into a [rows, BLOCK_N, BLOCK_K] FP32 tile reduced once after the loop (the loop
body is loads, converts and FMAs); the K tile shrinks as the rows grow, keeping the tile the size the config
sets at one row. No split-K and no atomics: each output element is one program's fixed-order sum, bitwise
identical run to run. Past MAX_ROWS (a prompt through a decode lock), where each row tile would read the
weights again, the rows go as the reference computes them: the weights dequantized into the model dtype for
a cuBLAS GEMM.

With a second weight (`up`) the program reads the same rows of gate and up and stores SwiGLU: g and u rounded
to the model dtype as the reference's GEMMs round them, silu(g) * u in FP32, rounded once.

Imported on the variants' first call, so their modules import without triton and TRITON_INTERPRET can be set
before this kernel is defined.
"""

import torch
import triton
import triton.language as tl

from beam_model.functional import linear
from beam_model.quant.tensors import Fp8Weight
from workbench.variants.kernels.fp8_decode import MAX_ROWS, fp8_weights
from workbench.variants.kernels.triton_common import pdl_enter, pdl_launch, round_to


@triton.jit
def fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, w2_ptr, s2_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWIGLU: tl.constexpr,
                    PDL: tl.constexpr = False):
    """y = (x @ w.T) * s.T, x [M, K] in the model dtype, w [N, K] E4M3, s [N] FP32 (SWIGLU: silu(that) times
    the same of w2, s2). Grid (N tiles, M tiles)."""
    pdl_enter(PDL)  # x comes from the previous kernel
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_off = offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    acc2 = acc  # the up rows' products (dead code without SWIGLU)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (offs_k + k0 < K)[None, :]
        xk = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok, other=0.0).to(tl.float32)[:, None, :]
        wk = tl.load(w_ptr + w_off + k0, mask=n_ok[:, None] & k_ok, other=0.0)
        acc += xk * wk.to(tl.float32)[None, :, :]
        if SWIGLU:
            wk2 = tl.load(w2_ptr + w_off + k0, mask=n_ok[:, None] & k_ok, other=0.0)
            acc2 += xk * wk2.to(tl.float32)[None, :, :]
    dtype = y_ptr.dtype.element_ty
    y = tl.sum(acc, axis=2) * tl.load(s_ptr + offs_n * stride_sn, mask=n_ok, other=0.0)[None, :]
    if SWIGLU:
        u = tl.sum(acc2, axis=2) * tl.load(s2_ptr + offs_n * stride_sn, mask=n_ok, other=0.0)[None, :]
        g = round_to(y, dtype).to(tl.float32)
        u = round_to(u, dtype).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u  # silu as torch computes it, in FP32
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], round_to(y, dtype), mask=m_ok[:, None] & n_ok[None, :])


def tiles(cfg: dict, m: int, k: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K) a launch at `cfg` takes for M rows of K inputs: the K tile shrinks as the rows grow,
    keeping the [rows, BLOCK_N, BLOCK_K] tile (registers a thread) the size the config sets at one row."""
    block_m = min(MAX_ROWS, triton.next_power_of_2(m))
    return block_m, min(max(16, cfg["BLOCK_K"] // block_m), triton.next_power_of_2(k))


def fp8_linear(x: torch.Tensor, w: Fp8Weight, cfg: dict, up: Fp8Weight | None = None) -> torch.Tensor:
    """x [M, K] @ dequantized(w).T in x's dtype, at tuning config `cfg` (BLOCK_N, BLOCK_K, num_warps,
    num_stages; optional pdl, see `pdl_launch`). With `up`: silu(x @ w.T) * (x @ up.T), w the gate.
    No host syncs: capturable in a CUDA graph."""
    w, second = fp8_weights(w, up, "the FP8 GEMV")
    if x.shape[0] > MAX_ROWS:  # static shape dispatch: graph-safe
        if up is None:
            return linear(x, w)
        return (torch.nn.functional.silu(linear(x, w).float()) * linear(x, up).float()).to(x.dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m, block_k = tiles(cfg, m, k)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, block_m))
    fp8_gemv_kernel[grid](x, w.weight, w.scale, second.weight, second.scale, y, m, n, k, x.stride(0),
                          w.weight.stride(0), w.scale.stride(0), BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"],
                          BLOCK_K=block_k, SWIGLU=up is not None, num_warps=cfg["num_warps"],
                          num_stages=cfg["num_stages"], **pdl_launch(cfg.get("pdl")))
    return y
