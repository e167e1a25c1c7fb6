"""Per-token E4M3 quantization of activations in one launch: each row of x scaled by its own amax / 448
(`beam_model.quant.formats.quantize_fp8`'s rule on rows of activations), codes and FP32 row scales out;
optionally with attention's output gate applied to the rows on the way (`attn_out:fp8_scaled_mm`).

One program a row (several short rows: a tile of TILE values a program) reads it twice (its amax, then its
codes; the second read mostly from L2), where the PyTorch rule makes an FP32 copy of x and several passes over
it: at a prompt of 16K tokens that rule alone took longer than the FP8 GEMM it feeds (runs/fp8-prefill-h100/,
`fp8-parts.json`).

The codes round to nearest even, on the GPU by the cast, under the CPU interpreter through the bits
(`_to_e4m3`). Imported on the variants' first call, so their modules import without triton and
TRITON_INTERPRET can be set before this kernel is defined.
"""

import torch
import triton
import triton.language as tl

from beam_model.quant.formats import E4M3_MAX
from workbench.variants.kernels.triton_common import INTERPRETED

BLOCK = 1024  # the most values of a row a program holds at once
TILE = 4096  # rows shorter than BLOCK share a program up to this many values
_INTERPRETED = tl.constexpr(INTERPRETED)


@triton.jit
def _to_e4m3(x):
    """FP32 `x` (finite, within +-448) rounded to nearest-even in E4M3, as torch's cast rounds. On the GPU
    the cast itself (cvt.rn); the interpreter's cast truncates, so there the value is rounded first, through
    the bits (3 mantissa bits kept), or on the 2^-9 grid of E4M3's subnormals below 2^-6, the sign kept."""
    if _INTERPRETED:
        bits = x.to(tl.uint32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        steps = tl.abs(x) * 512.0
        up = tl.floor(steps + 0.5)
        steps = up - tl.where((up == steps + 0.5) & (up % 2 != 0), 1.0, 0.0)
        sub = tl.where((bits >> 31) != 0, -steps, steps) / 512.0
        return tl.where(tl.abs(x) < 0.015625, sub, normal).to(tl.float8e4nv)
    else:
        return x.to(tl.float8e4nv)


@triton.jit
def _row_values(x_rows, g_rows, b_ptr, offs, row_ok, K, HEAD_DIM, GATED: tl.constexpr):
    """FP32 values of rows `x_rows` ([ROWS, 1] pointers) at `offs`: x itself, or with GATED attention's output
    gate applied as `attn_out`'s reference does (x * sigmoid(g + bias of the channel's head) in FP32, rounded once
    to x's dtype), so the gated rows never go through memory."""
    mask = row_ok & (offs < K)[None, :]
    x = tl.load(x_rows + offs[None, :], mask=mask, other=0.0)
    if GATED:
        g = tl.load(g_rows + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offs // HEAD_DIM, mask=offs < K, other=0.0).to(tl.float32)[None, :]
        x = (x.to(tl.float32) * tl.sigmoid(g + b)).to(x_rows.dtype.element_ty)
    return x.to(tl.float32)


@triton.jit
def _quantize_rows(x_ptr, g_ptr, b_ptr, codes_ptr, scale_ptr, used_ptr, N, K, HEAD_DIM, stride_x, stride_g, N_USED,
                   E4M3_MAX: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, GATED: tl.constexpr,
                   SOME: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    in_range = rows < N
    if SOME:  # only rows whose entry in `used` is below N_USED (the others are neither read nor written)
        in_range &= tl.load(used_ptr + rows, mask=in_range, other=N_USED) < N_USED
    row_ok = in_range[:, None]
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    g_rows = g_ptr + rows.to(tl.int64)[:, None] * stride_g
    amax = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for k in range(0, K, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(_row_values(x_rows, g_rows, b_ptr, offs, row_ok, K, HEAD_DIM, GATED)))
    m = tl.max(amax, 1)
    scale = tl.where(m > 0, m / E4M3_MAX, 1.0)
    for k in range(0, K, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        v = _row_values(x_rows, g_rows, b_ptr, offs, row_ok, K, HEAD_DIM, GATED)
        q = tl.clamp(v / scale[:, None], -E4M3_MAX, E4M3_MAX)
        tl.store(codes_ptr + rows.to(tl.int64)[:, None] * K + offs[None, :], _to_e4m3(q),
                 mask=row_ok & (offs < K)[None, :])
    tl.store(scale_ptr + rows, scale, mask=in_range)


def quantize_rows(x: torch.Tensor, gate: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                  used: tuple[torch.Tensor, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, K] (unit stride along K) -> (E4M3 codes [N, K], FP32 scales [N, 1]). With `gate` (g [N, K]
    unit stride along K, bias [heads], head_dim): the rows of x gated first, as `attn_out` gates them. With
    `used` (ids [N] int32, n): only rows whose id is below n; the others' codes and scales are left unwritten
    (a grouped GEMM's padding rows)."""
    n, k = x.shape
    codes = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(n, 1, dtype=torch.float32, device=x.device)
    g, bias, head_dim = gate if gate is not None else (x, x, 1)  # ungated: never read
    block = min(BLOCK, triton.next_power_of_2(k))
    rows = max(1, TILE // block)
    ids, n_used = used if used is not None else (scale, 0)  # all rows: never read
    if n:
        _quantize_rows[(triton.cdiv(n, rows),)](x, g, bias, codes, scale, ids, n, k, head_dim, x.stride(0),
                                                g.stride(0), n_used, E4M3_MAX=E4M3_MAX, ROWS=rows, BLOCK=block,
                                                GATED=gate is not None, SOME=used is not None, num_warps=4)
    return codes, scale
