"""Grouped GEMM kernels of `experts:triton_quantized_grouped`: experts:triton's grouped path (`moe.py`: routed
pairs sorted by expert into blocks of BLOCK_M rows, a gate/up GEMM with SwiGLU in its epilogue, a down GEMM into
per-pair rows rounded to the model dtype as the reference rounds them, the routing weights in a combine in FP32
rounded once) with the expert weights read as stored, FP8 or NVFP4
(`beam_model/quant/tensors.py`), and dequantized in registers into the tensor cores' operand (W8A16 / W4A16).

Each weight tile is loaded packed (the pipelined loads move the stored bytes) and turned into exact values of the
dot's operand format (bf16; fp16 for an fp16 model) before its dot, with no conversion instruction (E4M3 to bf16
takes a slow conversion pipe a value): the stored bits are placed into the format's bits, two values a register
as two adjacent inputs of the operand, and one packed multiply a register scales both:
- FP8: an E4M3 byte's exponent and mantissa bits go to the format's (E4M3 times a power of two, subnormals
  onto subnormals), its sign to the sign; the multiply is by the power of two back. The row's scale multiplies
  the FP32 accumulator in the epilogue.
- NVFP4: a byte's two codes go in as `moe_quantized_rows.e2m1_halves` places them (a multiply, two shifts and
  two masks a byte); the multiply is by the block's E4M3 scale times a power of two that makes it a normal
  number there, exact (at most 6 significant bits); scale_2 and the power of two's remainder multiply the
  accumulator in the epilogue.
So the dot sees each weight's exact dequantized value (the reference rounds code x scale x scale_2 to the model
dtype; here scale_2, or FP8's row scale, applies in FP32 after the dot).

The same kernels run `experts:triton_fp8_grouped` (W8A8): given x and the activation as E4M3 codes (quantized
per token by `fp8_rows.quantize_rows`), the FP8 weight tiles go to E4M3 x E4M3 dots as stored (FP8 tensor
cores, twice BF16's rate on Hopper), and each row's token scale joins the channel scale on the accumulator.

Imported on the variant's first call, so the point imports without triton and TRITON_INTERPRET can be set
before these kernels are defined.
"""

import torch
import triton
import triton.language as tl

from workbench.variants.kernels.fp8_rows import quantize_rows
from workbench.variants.kernels.moe import _INTERPRETED, _dot, align_by_expert, combine, swiglu
from workbench.variants.kernels.moe_quantized import checked_weights
from workbench.variants.kernels.moe_quantized_rows import SIGN_BITS, e2m1_halves
from workbench.variants.kernels.triton_common import pdl_enter, pdl_launch, round_to

# A block scale is multiplied into the codes as a normal number of the codes' format, so that a code times it is
# exact there (at most 6 significant bits, in the format's range): bf16 codes are E2M1 x 2^-126 and take the
# scale x 2^119, fp16 codes are E2M1 x 2^-14 and take the scale x 2^7; either way the tile holds
# code x scale x 2^-7, and the accumulator takes the 2^7 back.
SCALE_INTO_BF16 = tl.constexpr(2.0 ** 119)
SCALE_INTO_FP16 = tl.constexpr(2.0 ** 7)
NVFP4_TILE_SCALE = tl.constexpr(2.0 ** 7)


@triton.jit
def _packed_mul(a, b, BF16: tl.constexpr):
    """Each int32's two halves times those of `b`, as bf16x2 (BF16) or f16x2: one instruction a register (Triton
    multiplies 16-bit values one at a time, and the repacking around that costs more than the multiply)."""
    if BF16:
        return tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32,
                                         is_pure=True, pack=1)
    return tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True,
                                     pack=1)


@triton.jit
def _scaled_halves(halves, scale, BF16: tl.constexpr, INTERP: tl.constexpr):
    """The two 16-bit values in each int32 of `halves` (bf16 with BF16, else fp16) times `scale` (that format,
    shaped as `halves`): [..., 2], the low half first. On the GPU one packed multiply a register scales both."""
    dtype: tl.constexpr = tl.bfloat16 if BF16 else tl.float16
    if not INTERP:
        bits = scale.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        halves = _packed_mul(halves, bits | (bits << 16), BF16)
    values = tl.join(halves.to(tl.int16), (halves >> 16).to(tl.int16)).to(dtype, bitcast=True)
    if INTERP:
        values = values * tl.expand_dims(scale, len(scale.shape))
    return values


@triton.jit
def _nvfp4_tile(b, scale, BF16: tl.constexpr, INTERP: tl.constexpr):
    """The two codes of each byte of `b` (int32 values 0-255; the even input in the low nibble) times `scale`
    (float32, [..., 1]): [..., 2] in bf16 with BF16, else fp16, each code x scale x 2^-7 exactly. A byte's two
    codes are the two halves of one register (`e2m1_halves`), two adjacent inputs of the dot's operand."""
    halves = e2m1_halves(b * 4097, 0, BF16)  # b + (b << 12): the high nibble at bits 16-19, below it no code bits
    if BF16:
        factor = (scale * SCALE_INTO_BF16).to(tl.bfloat16)
    else:
        factor = (scale * SCALE_INTO_FP16).to(tl.float16)
    return _scaled_halves(halves, tl.broadcast_to(factor, halves.shape), BF16, INTERP)


@triton.jit
def _fp8_tile(raw, BF16: tl.constexpr, INTERP: tl.constexpr):
    """E4M3 bytes `raw` ([rows, n] int32 values 0-255) as their exact values: [rows, n // 2, 2] in bf16 with BF16,
    else fp16. Two adjacent bytes go to the two halves of one register with their exponent and mantissa bits
    placed into the format's (E4M3 x 2^-120 in bf16, x 2^-8 in fp16; E4M3's subnormals land on the format's)
    and the sign bit on its sign, then one packed multiply by the power of two back: no conversion instruction
    (converting E4M3 to bf16 takes a slow conversion pipe a value)."""
    even, odd = tl.split(tl.reshape(raw, [raw.shape[0], raw.shape[1] // 2, 2]))
    pairs = even | (odd << 16)
    LOW: tl.constexpr = 4 if BF16 else 7  # where the lowest mantissa bit goes
    halves = ((pairs << LOW) & (0x7F007F << LOW)) | ((pairs << 8) & SIGN_BITS)
    if BF16:
        factor = tl.full(halves.shape, 2.0 ** 120, tl.float32).to(tl.bfloat16)
    else:
        factor = tl.full(halves.shape, 2.0 ** 8, tl.float32).to(tl.float16)
    return _scaled_halves(halves, factor, BF16, INTERP)


@triton.jit
def dequantized_tile(w_ptr, s_ptr, e, offs_n, n_ok, k0, K, stride_we, stride_wn, stride_se, stride_sn,
                     BLOCK_K: tl.constexpr, NVFP4: tl.constexpr, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """Rows `offs_n` x inputs k0 .. k0 + BLOCK_K of expert e's weight, dequantized to DTYPE but for the row-wide
    factor (FP8's row scale; NVFP4's scale_2 and NVFP4_TILE_SCALE), which the caller applies after the dot:
    [BLOCK_N, BLOCK_K]. FP8 weights into an E4M3 dot (W8A8) are the stored values themselves."""
    # the tile is built in bf16 for a bf16 or fp32 model, else fp16; the interpreter's bf16 arithmetic is not
    # IEEE, so it takes fp16 (exact either way)
    BF16: tl.constexpr = (DTYPE != tl.float16) and (not INTERP)
    if NVFP4:
        BLOCKS: tl.constexpr = BLOCK_K // 16
        blk = tl.arange(0, BLOCKS)
        s_ok = n_ok[:, None] & (k0 // 16 + blk < K // 16)[None, :]
        scale = tl.load(s_ptr + e * stride_se + offs_n[:, None] * stride_sn + k0 // 16 + blk[None, :], mask=s_ok,
                        other=0.0).to(tl.float32)[:, :, None]  # a block's scale for its 8 bytes
        offs_b = tl.arange(0, BLOCK_K // 2)
        b_ok = n_ok[:, None] & (k0 // 2 + offs_b < K // 2)[None, :]
        b = tl.load(w_ptr + e * stride_we + offs_n[:, None] * stride_wn + k0 // 2 + offs_b[None, :], mask=b_ok,
                    other=0)
        b = tl.reshape(b, [offs_n.shape[0], BLOCKS, 8]).to(tl.int32)  # a block's 8 bytes on the last axis
        return tl.reshape(_nvfp4_tile(b, scale, BF16, INTERP), [offs_n.shape[0], BLOCK_K]).to(DTYPE)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        ok = n_ok[:, None] & (k0 + offs_k < K)[None, :]
        if DTYPE == tl.float8e4nv:
            return tl.load(w_ptr + e * stride_we + offs_n[:, None] * stride_wn + k0 + offs_k[None, :], mask=ok,
                           other=0.0)
        raw = tl.load(w_ptr.to(tl.pointer_type(tl.uint8)) + e * stride_we + offs_n[:, None] * stride_wn + k0
                      + offs_k[None, :], mask=ok, other=0).to(tl.int32)
        return tl.reshape(_fp8_tile(raw, BF16, INTERP), [offs_n.shape[0], BLOCK_K]).to(DTYPE)


@triton.jit
def _row_factor(s_ptr, s2_ptr, e, offs_n, n_ok, stride_se, stride_sn, NVFP4: tl.constexpr):
    """The factor a row's accumulator takes after the dot: [BLOCK_N] (NVFP4's scale_2 for every row)."""
    if NVFP4:
        return tl.zeros([offs_n.shape[0]], tl.float32) + tl.load(s2_ptr + e) * NVFP4_TILE_SCALE
    else:
        return tl.load(s_ptr + e * stride_se + offs_n * stride_sn, mask=n_ok, other=0.0)


@triton.jit
def gate_up_quantized_grouped_kernel(x_ptr, xs_ptr, pairs_ptr, block_expert_ptr, wg_ptr, wu_ptr, sg_ptr, su_ptr,
                                     sg2_ptr, su2_ptr, act_ptr, N_PAIRS, N_EXPERTS, HIDDEN, FF, stride_we, stride_wf,
                                     stride_se, stride_sf, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, N_BLOCKS_N: tl.constexpr,
                                     NVFP4: tl.constexpr, PRECISION: tl.constexpr, INTERP: tl.constexpr,
                                     PDL: tl.constexpr = False):
    """act[block rows, n-block] = silu(X_e @ gate[e].T) * (X_e @ up[e].T) for one expert's block of BLOCK_M
    routed rows, as `moe.gate_up_grouped_kernel`, each weight tile dequantized before its dot. With x in E4M3
    (W8A8: FP8 weights, E4M3 dots), each row's token scale (xs) on the accumulators too."""
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
    x_ptrs = x_ptr + tokens.to(tl.int64)[:, None] * HIDDEN + offs_k[None, :]
    dtype = x_ptr.dtype.element_ty
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        a = tl.load(x_ptrs + k0, mask=(offs_k + k0 < HIDDEN)[None, :], other=0.0)
        bg = dequantized_tile(wg_ptr, sg_ptr, e, offs_n, n_ok, k0, HIDDEN, stride_we, stride_wf, stride_se,
                              stride_sf, BLOCK_K, NVFP4, dtype, INTERP)
        bu = dequantized_tile(wu_ptr, su_ptr, e, offs_n, n_ok, k0, HIDDEN, stride_we, stride_wf, stride_se,
                              stride_sf, BLOCK_K, NVFP4, dtype, INTERP)
        acc_g = _dot(a, tl.trans(bg), acc_g, PRECISION, INTERP)
        acc_u = _dot(a, tl.trans(bu), acc_u, PRECISION, INTERP)
    g = acc_g * _row_factor(sg_ptr, sg2_ptr, e, offs_n, n_ok, stride_se, stride_sf, NVFP4)[None, :]
    u = acc_u * _row_factor(su_ptr, su2_ptr, e, offs_n, n_ok, stride_se, stride_sf, NVFP4)[None, :]
    if dtype == tl.float8e4nv:
        token_scale = tl.load(xs_ptr + tokens)[:, None]
        g *= token_scale
        u *= token_scale
    act = round_to(swiglu(g, u), act_ptr.dtype.element_ty)
    tl.store(act_ptr + offs_m.to(tl.int64)[:, None] * FF + offs_n[None, :], act, mask=n_ok[None, :])


@triton.jit
def down_quantized_grouped_kernel(act_ptr, as_ptr, pairs_ptr, block_expert_ptr, wd_ptr, sd_ptr, sd2_ptr,
                                  out_ptr, N_PAIRS, N_EXPERTS, HIDDEN, FF, stride_we, stride_wh, stride_se, stride_sh,
                                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                  N_BLOCKS_N: tl.constexpr, NVFP4: tl.constexpr, PRECISION: tl.constexpr,
                                  INTERP: tl.constexpr, PDL: tl.constexpr = False):
    """out[pair, n-block] = act[row] @ down[e].T for one expert's block of rows, rounded to the model dtype (the
    reference's rounding of an expert's output; half the bytes of FP32 rows to the combine), each pair its own row
    (scattered back to pair order) for `moe.combine` to weight and sum, as `moe.down_grouped_kernel` with ROUNDED.
    With the activation in E4M3 (W8A8), each row's scale (as) on the accumulator too."""
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
    a_ptrs = act_ptr + offs_m.to(tl.int64)[:, None] * FF + offs_k[None, :]
    dtype = act_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for f0 in range(0, FF, BLOCK_K):
        a = tl.load(a_ptrs + f0, mask=(offs_k + f0 < FF)[None, :], other=0.0)
        b = dequantized_tile(wd_ptr, sd_ptr, e, offs_n, n_ok, f0, FF, stride_we, stride_wh, stride_se, stride_sh,
                             BLOCK_K, NVFP4, dtype, INTERP)
        acc = _dot(a, tl.trans(b), acc, PRECISION, INTERP)
    rows = acc * _row_factor(sd_ptr, sd2_ptr, e, offs_n, n_ok, stride_se, stride_sh, NVFP4)[None, :]
    if dtype == tl.float8e4nv:
        rows *= tl.load(as_ptr + offs_m)[:, None]
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * HIDDEN + offs_n[None, :],
             round_to(rows, out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


# ---- entry point -----------------------------------------------------------------------------------

def quantized_grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: dict, cfg: dict,
                              w8a8: bool = False) -> torch.Tensor:
    """The `experts` contract on FP8 or NVFP4 expert weights through grouped GEMMs, at one of the variant's
    tuning configs. `w8a8` (FP8 weights only): x and the activation quantized per token to E4M3 and the GEMMs
    on FP8 tensor cores (`experts:triton_fp8_grouped`), the activation's padding rows skipped."""
    name = "experts:triton_fp8_grouped" if w8a8 else "experts:triton_quantized_grouped"
    fmt, (wg, sg, sg2), (wu, su, su2), (wd, sd, sd2) = checked_weights(w, name)
    if w8a8 and fmt != "fp8":
        raise ValueError(f"{name} reads FP8 expert weights, got {fmt}")
    nvfp4 = fmt == "nvfp4"
    n, top_k = ids.shape
    n_experts, ff, hidden = wg.shape[0], wg.shape[1], x.shape[1]
    x, ids, rw = x.contiguous(), ids.contiguous(), weights.contiguous().float()
    n_pairs = n * top_k
    if n_pairs == 0:
        return torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    pdl = cfg.get("pdl", False)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    xq, x_scale = quantize_rows(x) if w8a8 else (x, rw)  # rw: never read
    sorted_pairs, block_expert = align_by_expert(ids, n_experts, bm, pdl)
    n_blocks = block_expert.numel()
    act = torch.empty(n_blocks * bm, ff, dtype=x.dtype, device=x.device)
    precision = "ieee" if x.dtype == torch.float32 and not w8a8 else None
    common = dict(NVFP4=nvfp4, PRECISION=precision, INTERP=_INTERPRETED, **pdl_launch(pdl))
    grid_n = triton.cdiv(ff, bn)
    gate_up_quantized_grouped_kernel[(n_blocks * grid_n,)](
        xq, x_scale, sorted_pairs, block_expert, wg, wu, sg, su, sg2, su2, act, n_pairs, n_experts, hidden, ff,
        wg.stride(0), wg.stride(1), sg.stride(0), sg.stride(1), TOP_K=top_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        N_BLOCKS_N=grid_n, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **common)
    aq, a_scale = quantize_rows(act, used=(sorted_pairs, n_pairs)) if w8a8 else (act, rw)  # rw: never read
    out = torch.empty(n_pairs, hidden, dtype=x.dtype, device=x.device)
    bn, bk = cfg.get("DOWN_BLOCK_N", bn), cfg.get("DOWN_BLOCK_K", bk)
    grid_n = triton.cdiv(hidden, bn)
    down_quantized_grouped_kernel[(n_blocks * grid_n,)](
        aq, a_scale, sorted_pairs, block_expert, wd, sd, sd2, out, n_pairs, n_experts, hidden, ff,
        wd.stride(0), wd.stride(1), sd.stride(0), sd.stride(1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        N_BLOCKS_N=grid_n, num_warps=cfg.get("DOWN_WARPS", cfg["num_warps"]),
        num_stages=cfg.get("DOWN_STAGES", cfg["num_stages"]), **common)
    return combine(out, rw, top_k, weighted=True, dtype=x.dtype, pdl=pdl)
