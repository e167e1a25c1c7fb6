"""Decode GEMV kernels of `experts:triton_quantized_rows`: `experts:triton_rows`' shape of work (`moe_rows.py`:
each program loads its weight rows whole, a block of rows at a time, the next block's loads issued before the
block before it is reduced) on expert weights stored as FP8 or NVFP4 (`beam_model/quant/tensors.py`), read as
stored and dequantized in registers.

- FP8: the rows are E4M3 bytes, split into two power-of-two pieces as in `moe_rows.py`; the row's scale
  multiplies its FP32 sum once.
- NVFP4: a row is read as 64-bit words, one a scale block (16 codes, 8 bytes), beside its E4M3 block scales.
  At a quarter of BF16's bytes the decode's arithmetic, not the bytes, can bound this GEMV (an integer-to-float
  conversion issues at a quarter of the FMA rate), so each code costs a few integer operations and no such
  conversion: the three magnitude bits of a code go to fp16's exponent low bits and mantissa top bit and its
  sign to fp16's sign, two codes a 32-bit word (nibbles k and k + 4 of a word land 16 bits apart, so two
  shifts and two masks place both), and each half converts to FP32 exactly. fp16's subnormal and normal grid at
  those bits is E2M1's scaled by 2^-14, so a block's 16 products are summed,
  times the block's scale, and the row's sum takes scale_2 and the 2^14 once.

Every output element is written by one program in a fixed order, with no atomics: results are bitwise
identical run to run; the activation is rounded once, the top_k combine is FP32 and rounded once, as in
`moe.py`'s GEMV path. Imported on the variant's first call, so the point imports without triton and
TRITON_INTERPRET can be set before these kernels are defined.
"""

import torch
import triton
import triton.language as tl

from workbench.variants.kernels.moe import swiglu_store
from workbench.variants.kernels.moe_quantized import checked_weights
from workbench.variants.kernels.moe_rows import down_tiles, gate_up_tiles, pieces
from workbench.variants.kernels.triton_common import pdl_enter, pdl_launch, round_to

E2M1_FROM_FP16 = tl.constexpr(16384.0)  # 2^14: an E2M1 value over the fp16 its bits are placed into
SIGN_BITS = tl.constexpr(-0x7FFF8000)  # 0x80008000 as an int32: the sign bit of both 16-bit halves


@triton.jit
def _shifted(word, N: tl.constexpr):
    """`word` shifted left by N bits (right by -N when N < 0)."""
    if N >= 0:
        return word << N
    return word >> -N


@triton.jit
def e2m1_halves(word, K: tl.constexpr, BF16: tl.constexpr = False):
    """The codes of nibbles K and K + 4 of each int32 `word` as the two halves of an int32 (nibble K low), each
    fp16 (E2M1 times 2^-14), or bf16 (E2M1 times 2^-126) with BF16: the code's three magnitude bits (bits
    4K..4K+2) go to the format's two lowest exponent bits and its top mantissa bit, its sign (bit 4K+3) to bit
    15, and nibble K + 4 lands 16 bits higher by the same two shifts. The codes of magnitude 0.5 are subnormal."""
    TOP: tl.constexpr = 6 if BF16 else 9  # the top mantissa bit
    magnitude = _shifted(word, TOP - 4 * K) & ((7 << TOP) | (7 << (TOP + 16)))
    return magnitude | (_shifted(word, 12 - 4 * K) & SIGN_BITS)


@triton.jit
def _e2m1_pair(word, K: tl.constexpr):
    """The codes of nibbles K and K + 4 of each int32 `word`, as FP32 values times 2^-14 (two tensors)."""
    halves = e2m1_halves(word, K)
    lo = halves.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (halves >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _word_dot(word, x, H: tl.constexpr):
    """sum_i code_i(word) * x[8H + i] over the 8 codes of each int32 `word` (code i in nibble i), times 2^-14.
    Elementwise throughout: the products stay in the words' layout, with no reduction across threads."""
    lo0, hi0 = _e2m1_pair(word, 0)
    lo1, hi1 = _e2m1_pair(word, 1)
    lo2, hi2 = _e2m1_pair(word, 2)
    lo3, hi3 = _e2m1_pair(word, 3)
    return (lo0 * x[8 * H] + hi0 * x[8 * H + 4] + lo1 * x[8 * H + 1] + hi1 * x[8 * H + 5]
            + lo2 * x[8 * H + 2] + hi2 * x[8 * H + 6] + lo3 * x[8 * H + 3] + hi3 * x[8 * H + 7])


@triton.jit
def _nvfp4_dot(words, scales, x):
    """Each int64 word's 16 products with its block's inputs `x` (a tuple of 16 tensors, input i of each block
    at x[i]), summed, times the block's E4M3 scale and 2^-14: shaped as `words`."""
    return (_word_dot(words.to(tl.int32), x, 0) + _word_dot((words >> 32).to(tl.int32), x, 1)) \
        * scales.to(tl.float32)


@triton.jit
def block_inputs(first, mask):
    """The 16 inputs of each scale block, `first` pointing at each block's first: a tuple of FP32 tensors shaped
    as `first`, loaded once a program (L2 hits), so the products keep the weights' layout."""
    return (tl.load(first, mask=mask, other=0.0).to(tl.float32),
            tl.load(first + 1, mask=mask, other=0.0).to(tl.float32),
            tl.load(first + 2, mask=mask, other=0.0).to(tl.float32),
            tl.load(first + 3, mask=mask, other=0.0).to(tl.float32),
            tl.load(first + 4, mask=mask, other=0.0).to(tl.float32),
            tl.load(first + 5, mask=mask, other=0.0).to(tl.float32),
            tl.load(first + 6, mask=mask, other=0.0).to(tl.float32),
            tl.load(first + 7, mask=mask, other=0.0).to(tl.float32),
            tl.load(first + 8, mask=mask, other=0.0).to(tl.float32),
            tl.load(first + 9, mask=mask, other=0.0).to(tl.float32),
            tl.load(first + 10, mask=mask, other=0.0).to(tl.float32),
            tl.load(first + 11, mask=mask, other=0.0).to(tl.float32),
            tl.load(first + 12, mask=mask, other=0.0).to(tl.float32),
            tl.load(first + 13, mask=mask, other=0.0).to(tl.float32),
            tl.load(first + 14, mask=mask, other=0.0).to(tl.float32),
            tl.load(first + 15, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _nvfp4_gate_up_tiles(wg_ptr, wu_ptr, sg_ptr, su_ptr, rows, s_rows, ok, A: tl.constexpr, B: tl.constexpr,
                         BLOCKS: tl.constexpr):
    """Gate and up rows (words and block scales) of one expert, whole, as pieces A and B of BLOCKS blocks."""
    # one word a thread, as the block inputs (16 apart) load: given two a thread, Triton 3.6 moves every decoded
    # code to the inputs' layout through shared memory
    ba = tl.max_contiguous(tl.arange(0, A), 1)[None, :]
    bb = A + tl.max_contiguous(tl.arange(0, B), 1)[None, :]
    b_ok = ok & (bb < BLOCKS)
    return (tl.load(wg_ptr + rows + ba, mask=ok, other=0), tl.load(wu_ptr + rows + ba, mask=ok, other=0),
            tl.load(wg_ptr + rows + bb, mask=b_ok, other=0), tl.load(wu_ptr + rows + bb, mask=b_ok, other=0),
            tl.load(sg_ptr + s_rows + ba, mask=ok, other=0.0), tl.load(su_ptr + s_rows + ba, mask=ok, other=0.0),
            tl.load(sg_ptr + s_rows + bb, mask=b_ok, other=0.0), tl.load(su_ptr + s_rows + bb, mask=b_ok, other=0.0))


@triton.jit
def gate_up_quantized_rows_kernel(x_ptr, ids_ptr, wg_ptr, wu_ptr, sg_ptr, su_ptr, sg2_ptr, su2_ptr, act_ptr, FF,
                                  stride_we, stride_wf, stride_se, stride_sf, HIDDEN: tl.constexpr,
                                  A: tl.constexpr, B: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                                  STEPS: tl.constexpr, NVFP4: tl.constexpr, PDL: tl.constexpr = False):
    """act[pair, rows] = silu(x[token] @ gate[e].T) * (x[token] @ up[e].T), e = ids[pair], for STEPS blocks of
    BLOCK_N whole rows of gate and of up per program, double-buffered as `moe_rows.gate_up_rows_kernel`. NVFP4:
    the weights are int64 words, A + B of them (pieces of HIDDEN / 16 blocks) a row; FP8: E4M3, A + B inputs."""
    pdl_enter(PDL)  # the routed ids (and x) come from earlier kernels
    pair = tl.program_id(0)
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * HIDDEN
    e = tl.load(ids_ptr + pair).to(tl.int64)
    n0 = tl.program_id(1) * (BLOCK_N * STEPS)
    end = tl.minimum(n0 + BLOCK_N * STEPS, FF)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if NVFP4:
        BLOCKS: tl.constexpr = HIDDEN // 16
        rows = e * stride_we + offs_n[:, None].to(tl.int64) * stride_wf
        s_rows = e * stride_se + offs_n[:, None].to(tl.int64) * stride_sf
        tiles = _nvfp4_gate_up_tiles(wg_ptr, wu_ptr, sg_ptr, su_ptr, rows, s_rows, (offs_n < end)[:, None], A, B,
                                     BLOCKS)
        ba = tl.arange(0, A)[None, :]
        bb = A + tl.arange(0, B)[None, :]
        xa = block_inputs(x_row + 16 * ba, ba < BLOCKS)
        xb = block_inputs(x_row + 16 * bb, bb < BLOCKS)
        g_scale = tl.load(sg2_ptr + e) * E2M1_FROM_FP16
        u_scale = tl.load(su2_ptr + e) * E2M1_FROM_FP16
    else:
        tiles = gate_up_tiles(wg_ptr, wu_ptr, e, offs_n, end, stride_we, stride_wf, HIDDEN, A, B)
        ha = tl.arange(0, A)[None, :]
        hb = A + tl.arange(0, B)[None, :]
        xa = tl.load(x_row + ha).to(tl.float32)
        xb = tl.load(x_row + hb, mask=hb < HIDDEN, other=0.0).to(tl.float32)
    for s in tl.static_range(STEPS):
        if NVFP4:
            if s + 1 < STEPS:  # constexpr
                ahead = _nvfp4_gate_up_tiles(wg_ptr, wu_ptr, sg_ptr, su_ptr, rows + BLOCK_N * stride_wf,
                                             s_rows + BLOCK_N * stride_sf, (offs_n + BLOCK_N < end)[:, None], A, B,
                                             BLOCKS)
            ga, ua, gb, ub, sga, sua, sgb, sub = tiles
            g = (tl.sum(_nvfp4_dot(ga, sga, xa), axis=1) + tl.sum(_nvfp4_dot(gb, sgb, xb), axis=1)) * g_scale
            u = (tl.sum(_nvfp4_dot(ua, sua, xa), axis=1) + tl.sum(_nvfp4_dot(ub, sub, xb), axis=1)) * u_scale
        else:
            if s + 1 < STEPS:  # constexpr
                ahead = gate_up_tiles(wg_ptr, wu_ptr, e, offs_n + BLOCK_N, end, stride_we, stride_wf, HIDDEN, A, B)
            ga, ua, gb, ub = tiles
            s_off = e * stride_se + offs_n * stride_sf
            n_ok = offs_n < end
            g = (tl.sum(ga.to(tl.float32) * xa, axis=1) + tl.sum(gb.to(tl.float32) * xb, axis=1)) \
                * tl.load(sg_ptr + s_off, mask=n_ok, other=0.0)
            u = (tl.sum(ua.to(tl.float32) * xa, axis=1) + tl.sum(ub.to(tl.float32) * xb, axis=1)) \
                * tl.load(su_ptr + s_off, mask=n_ok, other=0.0)
        swiglu_store(g, u, act_ptr + pair.to(tl.int64) * FF + offs_n, offs_n < end)
        if s + 1 < STEPS:
            tiles = ahead
            offs_n += BLOCK_N
            if NVFP4:
                rows += BLOCK_N * stride_wf
                s_rows += BLOCK_N * stride_sf


@triton.jit
def _nvfp4_down_tiles(wd_ptr, sd_ptr, rows, s_rows, ok, A: tl.constexpr, B: tl.constexpr, BLOCKS: tl.constexpr):
    """Down rows (words and block scales) of each of the token's experts, whole, as pieces A and B."""
    ba = tl.arange(0, A)[None, None, :]
    bb = A + tl.arange(0, B)[None, None, :]
    b_ok = ok & (bb < BLOCKS)
    return (tl.load(wd_ptr + rows + ba, mask=ok, other=0), tl.load(wd_ptr + rows + bb, mask=b_ok, other=0),
            tl.load(sd_ptr + s_rows + ba, mask=ok, other=0.0), tl.load(sd_ptr + s_rows + bb, mask=b_ok, other=0.0))


@triton.jit
def down_quantized_rows_kernel(act_ptr, ids_ptr, rw_ptr, wd_ptr, sd_ptr, sd2_ptr, y_ptr, HIDDEN, stride_we,
                               stride_wh, stride_se, stride_sh, FF: tl.constexpr, A: tl.constexpr, B: tl.constexpr,
                               TOP_K: tl.constexpr, K_P2: tl.constexpr, BLOCK_N: tl.constexpr,
                               STEPS: tl.constexpr, NVFP4: tl.constexpr, PDL: tl.constexpr = False):
    """y[token, rows] = sum_k rw[token, k] * (act[token, k] @ down[ids[token, k]].T), rounded once, for STEPS
    blocks of BLOCK_N whole rows of each of the token's top_k experts per program ([top_k, BLOCK_N, row] tiles,
    double-buffered); each expert's row sums take its scales and routing weight once."""
    pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * (BLOCK_N * STEPS)
    end = tl.minimum(n0 + BLOCK_N * STEPS, HIDDEN)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    slot = tl.arange(0, K_P2)
    slot_ok = slot < TOP_K
    pairs = token * TOP_K + slot
    e = tl.load(ids_ptr + pairs, mask=slot_ok, other=0).to(tl.int64)
    rw = tl.load(rw_ptr + pairs, mask=slot_ok, other=0.0)
    rows = e[:, None, None] * stride_we + offs_n[None, :, None].to(tl.int64) * stride_wh
    w_ok = slot_ok[:, None, None]
    a_rows = act_ptr + pairs * FF
    if NVFP4:
        BLOCKS: tl.constexpr = FF // 16
        s_rows = e[:, None, None] * stride_se + offs_n[None, :, None].to(tl.int64) * stride_sh
        tiles = _nvfp4_down_tiles(wd_ptr, sd_ptr, rows, s_rows, w_ok & (offs_n < end)[None, :, None], A, B, BLOCKS)
        ba = tl.arange(0, A)[None, None, :]
        bb = A + tl.arange(0, B)[None, None, :]
        a_ok = slot_ok[:, None, None]
        aa = block_inputs(a_rows[:, None, None] + 16 * ba, a_ok & (ba < BLOCKS))
        ab = block_inputs(a_rows[:, None, None] + 16 * bb, a_ok & (bb < BLOCKS))
        per_slot = rw * tl.load(sd2_ptr + e, mask=slot_ok, other=0.0) * E2M1_FROM_FP16
    else:
        tiles = down_tiles(wd_ptr + rows, w_ok, offs_n, end, FF, A, B)
        fa = tl.arange(0, A)[None, :]
        fb = A + tl.arange(0, B)[None, :]
        aa = tl.load(a_rows[:, None] + fa, mask=slot_ok[:, None], other=0.0).to(tl.float32)[:, None, :]
        ab = tl.load(a_rows[:, None] + fb, mask=slot_ok[:, None] & (fb < FF), other=0.0).to(tl.float32)[:, None, :]
    for s in tl.static_range(STEPS):
        if NVFP4:
            if s + 1 < STEPS:  # constexpr
                ahead = _nvfp4_down_tiles(wd_ptr, sd_ptr, rows + BLOCK_N * stride_wh, s_rows + BLOCK_N * stride_sh,
                                          w_ok & (offs_n + BLOCK_N < end)[None, :, None], A, B, BLOCKS)
            wa, wb, sa, sb = tiles
            acc = (tl.sum(_nvfp4_dot(wa, sa, aa), axis=2) + tl.sum(_nvfp4_dot(wb, sb, ab), axis=2)) \
                * per_slot[:, None]
        else:
            if s + 1 < STEPS:  # constexpr
                ahead = down_tiles(wd_ptr + rows + BLOCK_N * stride_wh, w_ok, offs_n + BLOCK_N, end, FF, A, B)
            wa, wb = tiles
            s_ok = slot_ok[:, None] & (offs_n < end)[None, :]
            row_scale = tl.load(sd_ptr + e[:, None] * stride_se + offs_n[None, :] * stride_sh, mask=s_ok, other=0.0)
            acc = (tl.sum(wa.to(tl.float32) * aa, axis=2) + tl.sum(wb.to(tl.float32) * ab, axis=2)) \
                * row_scale * rw[:, None]
        y = round_to(tl.sum(acc, axis=0), y_ptr.dtype.element_ty)
        tl.store(y_ptr + token * HIDDEN + offs_n, y, mask=offs_n < end)
        if s + 1 < STEPS:
            tiles = ahead
            rows += BLOCK_N * stride_wh
            offs_n += BLOCK_N
            if NVFP4:
                s_rows += BLOCK_N * stride_sh


# ---- entry point -----------------------------------------------------------------------------------

def _stored(parts, fmt: str):
    """(weight, scale, scale_2) as the kernels index them: NVFP4 bytes as int64 words, a scale block each."""
    weight, scale, scale_2 = parts
    if fmt != "nvfp4":
        return weight, scale, scale_2
    if weight.shape[-1] % 8 or weight.data_ptr() % 8:
        raise ValueError("experts:triton_quantized_rows reads NVFP4 weights as 8-byte words: their rows must hold "
                         f"whole scale blocks and start 8-byte aligned (row of {weight.shape[-1]} bytes)")
    return weight.view(torch.int64), scale, scale_2


def quantized_experts_rows(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: dict,
                           cfg: dict) -> torch.Tensor:
    """The `experts` contract on FP8 or NVFP4 expert weights, at one of the variant's tuning configs."""
    fmt, *parts = checked_weights(w, "experts:triton_quantized_rows")
    (wg, sg, sg2), (wu, su, su2), (wd, sd, sd2) = (_stored(p, fmt) for p in parts)
    nvfp4 = fmt == "nvfp4"
    n, top_k = ids.shape
    ff, hidden = parts[0][0].shape[1], x.shape[1]
    x, ids, rw = x.contiguous(), ids.contiguous(), weights.contiguous().float()
    y = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    act = torch.empty(n * top_k, ff, dtype=x.dtype, device=x.device)
    launch = dict(NVFP4=nvfp4, num_stages=1, **pdl_launch(cfg.get("pdl")))
    unit = 16 if nvfp4 else 1  # a row's pieces count words (scale blocks) or E4M3 inputs
    a, b = pieces(hidden // unit)
    bn, steps = cfg["BLOCK_N"], cfg.get("STEPS", 1)
    gate_up_quantized_rows_kernel[(n * top_k, triton.cdiv(ff, bn * steps))](
        x, ids, wg, wu, sg, su, sg2, su2, act, ff, wg.stride(0), wg.stride(1), sg.stride(0), sg.stride(1),
        HIDDEN=hidden, A=a, B=b, TOP_K=top_k, BLOCK_N=bn, STEPS=steps, num_warps=cfg["num_warps"], **launch)
    a, b = pieces(ff // unit)
    bn, steps = cfg["DOWN_BLOCK_N"], cfg.get("DOWN_STEPS", 1)
    down_quantized_rows_kernel[(n, triton.cdiv(hidden, bn * steps))](
        act, ids, rw, wd, sd, sd2, y, hidden, wd.stride(0), wd.stride(1), sd.stride(0), sd.stride(1), FF=ff, A=a,
        B=b, TOP_K=top_k, K_P2=triton.next_power_of_2(top_k), BLOCK_N=bn, STEPS=steps, num_warps=cfg["DOWN_WARPS"],
        **launch)
    return y
