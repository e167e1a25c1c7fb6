"""Triton kernels of `experts:triton_rows` (and of `experts:triton_persistent`, which reuses their
tiles): the decode GEMV path of `experts:triton` (`moe.py`), with each program's weight rows loaded
whole, a block of rows at a time, instead of in a loop of BLOCK_K slices; with STEPS > 1 a program
takes several blocks and double-buffers them.

Why: a decode GEMV's speed follows the number of serial load steps per program, not the bytes each
program moves; Triton pipelines only loads that feed tl.dot (num_stages does nothing for these), and
wider slices spill registers (docs/decisions.md #26). Here a program issues every load of a block of
whole rows at once and then reduces it, and the next block's loads go out before that reduction, so
memory is never waiting on the program's arithmetic.

A row's length is split into two power-of-two pieces loaded side by side (hidden 5120 = 4096 + 1024,
ff 320 = 256 + 64 at TP8; the second masked when the rest is not a power of two), so no lane is
padding. Summation order is fixed (no atomics): results are bitwise reproducible; the activation is
rounded once, the top_k combine is FP32 and rounded once, as in `moe.py`'s GEMV path.
"""

import torch
import triton
import triton.language as tl

from workbench.variants.kernels.moe import checked_weights, gate_up_gemv_kernel, swiglu_store
from workbench.variants.kernels.triton_common import pdl_enter, pdl_launch, round_to

# Registers: a config is only run where each thread's share of the largest tile (bf16 weight elements)
# stays under this; past it the kernel spills and streams slower (docs/decisions.md #26).
MAX_ELEMENTS_PER_THREAD = 128


def pieces(n: int) -> tuple[int, int]:
    """`n` as a power of two plus the power of two covering the rest: 5120 -> (4096, 1024), 70 -> (64, 8).
    With no rest the second piece is one lane, always masked (one code path): 64 -> (64, 1)."""
    a = 1 << (n.bit_length() - 1)
    return a, triton.next_power_of_2(n - a) if n > a else 1


@triton.jit
def gate_up_tiles(wg_ptr, wu_ptr, e, offs_n, end, stride_we, stride_wf,
                  HIDDEN: tl.constexpr, H_A: tl.constexpr, H_B: tl.constexpr):
    """Gate and up rows `offs_n` (those below `end`) of expert e, whole, as pieces A and B."""
    ok = (offs_n < end)[:, None]
    rows = e * stride_we + offs_n[:, None].to(tl.int64) * stride_wf
    ha = tl.arange(0, H_A)[None, :]
    hb = H_A + tl.arange(0, H_B)[None, :]
    b_ok = ok & (hb < HIDDEN)
    return (tl.load(wg_ptr + rows + ha, mask=ok, other=0.0), tl.load(wu_ptr + rows + ha, mask=ok, other=0.0),
            tl.load(wg_ptr + rows + hb, mask=b_ok, other=0.0), tl.load(wu_ptr + rows + hb, mask=b_ok, other=0.0))


@triton.jit
def gate_up_rows_kernel(x_ptr, ids_ptr, wg_ptr, wu_ptr, act_ptr, FF, stride_we, stride_wf,
                        HIDDEN: tl.constexpr, H_A: tl.constexpr, H_B: tl.constexpr, TOP_K: tl.constexpr,
                        BLOCK_N: tl.constexpr, STEPS: tl.constexpr, PDL: tl.constexpr = False):
    """act[pair, rows] = silu(x[token] @ gate[e].T) * (x[token] @ up[e].T), e = ids[pair], for STEPS
    blocks of BLOCK_N whole rows of gate and of up per program. Each block's loads are issued before
    the block before it is reduced (double buffering by hand: Triton pipelines only loads that feed
    tl.dot), so a program always has rows in flight."""
    pdl_enter(PDL)  # the routed ids (and x) come from earlier kernels
    pair = tl.program_id(0)
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * HIDDEN
    e = tl.load(ids_ptr + pair).to(tl.int64)
    n0 = tl.program_id(1) * (BLOCK_N * STEPS)
    end = tl.minimum(n0 + BLOCK_N * STEPS, FF)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    tiles = gate_up_tiles(wg_ptr, wu_ptr, e, offs_n, end, stride_we, stride_wf, HIDDEN, H_A, H_B)
    ha = tl.arange(0, H_A)[None, :]
    hb = H_A + tl.arange(0, H_B)[None, :]
    xa = tl.load(x_row + ha).to(tl.float32)
    xb = tl.load(x_row + hb, mask=hb < HIDDEN, other=0.0).to(tl.float32)
    for s in tl.static_range(STEPS):
        if s + 1 < STEPS:  # constexpr
            ahead = gate_up_tiles(wg_ptr, wu_ptr, e, offs_n + BLOCK_N, end, stride_we, stride_wf, HIDDEN, H_A, H_B)
        ga, ua, gb, ub = tiles
        g = tl.sum(ga.to(tl.float32) * xa, axis=1) + tl.sum(gb.to(tl.float32) * xb, axis=1)
        u = tl.sum(ua.to(tl.float32) * xa, axis=1) + tl.sum(ub.to(tl.float32) * xb, axis=1)
        swiglu_store(g, u, act_ptr + pair.to(tl.int64) * FF + offs_n, offs_n < end)
        if s + 1 < STEPS:
            tiles = ahead
            offs_n += BLOCK_N


@triton.jit
def down_tiles(rows, w_ok, offs_n, end, FF: tl.constexpr, F_A: tl.constexpr, F_B: tl.constexpr):
    """Down rows `offs_n` (those below `end`) of each of the token's experts, whole, as pieces A and B."""
    ok = w_ok & (offs_n < end)[None, :, None]
    fa = tl.arange(0, F_A)[None, None, :]
    fb = F_A + tl.arange(0, F_B)[None, None, :]
    return tl.load(rows + fa, mask=ok, other=0.0), tl.load(rows + fb, mask=ok & (fb < FF), other=0.0)


@triton.jit
def down_rows_kernel(act_ptr, ids_ptr, rw_ptr, wd_ptr, y_ptr, HIDDEN, stride_we, stride_wh,
                     FF: tl.constexpr, F_A: tl.constexpr, F_B: tl.constexpr, TOP_K: tl.constexpr,
                     K_P2: tl.constexpr, BLOCK_N: tl.constexpr, STEPS: tl.constexpr, PDL: tl.constexpr = False):
    """y[token, rows] = sum_k rw[token, k] * (act[token, k] @ down[ids[token, k]].T), rounded once, for
    STEPS blocks of BLOCK_N whole rows of each of the token's top_k experts per program, double
    buffered as in `gate_up_rows_kernel`."""
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
    rows = wd_ptr + e[:, None, None] * stride_we + offs_n[None, :, None].to(tl.int64) * stride_wh
    w_ok = slot_ok[:, None, None]
    tiles = down_tiles(rows, w_ok, offs_n, end, FF, F_A, F_B)
    # the activation stays in the model dtype until used (registers); the routing weight scales each
    # expert's FP32 row sum
    a_rows = act_ptr + pairs[:, None] * FF
    fa = tl.arange(0, F_A)[None, :]
    fb = F_A + tl.arange(0, F_B)[None, :]
    aa = tl.load(a_rows + fa, mask=slot_ok[:, None], other=0.0)
    ab = tl.load(a_rows + fb, mask=slot_ok[:, None] & (fb < FF), other=0.0)
    for s in tl.static_range(STEPS):
        if s + 1 < STEPS:  # constexpr
            ahead = down_tiles(rows + BLOCK_N * stride_wh, w_ok, offs_n + BLOCK_N, end, FF, F_A, F_B)
        wa, wb = tiles
        acc = tl.sum(wa.to(tl.float32) * aa.to(tl.float32)[:, None, :], axis=2) \
            + tl.sum(wb.to(tl.float32) * ab.to(tl.float32)[:, None, :], axis=2)
        y = round_to(tl.sum(acc * rw[:, None], axis=0), y_ptr.dtype.element_ty)
        tl.store(y_ptr + token * HIDDEN + offs_n, y, mask=offs_n < end)
        if s + 1 < STEPS:
            tiles = ahead
            rows += BLOCK_N * stride_wh
            offs_n += BLOCK_N


def elements_per_thread(config: dict, hidden: int, ff: int, top_k: int) -> int:
    """The larger of the two kernels' bf16 weight elements per thread at this config (register use)."""
    row = config.get("BLOCK_K") or sum(pieces(hidden))  # BLOCK_K: the looped kernel's slice
    buffers = 2 if config.get("STEPS", 1) > 1 else 1  # a block in flight beside the one being reduced
    gate_up = buffers * 2 * config["BLOCK_N"] * row // (32 * config["num_warps"])
    buffers = 2 if config.get("DOWN_STEPS", 1) > 1 else 1
    down = buffers * triton.next_power_of_2(top_k) * config["DOWN_BLOCK_N"] * sum(pieces(ff)) \
        // (32 * config["DOWN_WARPS"])
    return max(gate_up, down)


def decode_operands(x, ids, weights, w, variant: str):
    """The decode GEMVs' operands: checked weights, contiguous inputs, FP32 routing weights, and the
    output and SwiGLU activation buffers."""
    wg, wu, wd = checked_weights(w, variant)
    n, top_k = ids.shape
    ff, hidden = wg.shape[1], wg.shape[2]
    y = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    act = torch.empty(n * top_k, ff, dtype=x.dtype, device=x.device)
    return wg, wu, wd, x.contiguous(), ids.contiguous(), weights.contiguous().float(), y, act


def fused_experts_rows(x, ids, weights, w, config: dict):
    """The `experts` contract for a few routed pairs (decode); `config` is one of the variant's."""
    wg, wu, wd, x, ids, rw, y, act = decode_operands(x, ids, weights, w, "experts:triton_rows")
    n, top_k = ids.shape
    ff, hidden = wg.shape[1], wg.shape[2]
    if n == 0:
        return y
    pdl = pdl_launch(config.get("pdl"))
    bn = config["BLOCK_N"]
    if "BLOCK_K" in config:  # experts:triton's looped gate/up GEMV: times the new down kernel alone
        gate_up_gemv_kernel[(n * top_k, triton.cdiv(ff, bn), 1)](
            x, ids, wg, wu, act, act, act, hidden, ff, triton.cdiv(hidden, config["BLOCK_K"]) * config["BLOCK_K"],
            wg.stride(0), wg.stride(1), TOP_K=top_k, BLOCK_N=bn, BLOCK_K=config["BLOCK_K"], SPLIT=1,
            num_warps=config["num_warps"], num_stages=1, **pdl)
    else:
        h_a, h_b = pieces(hidden)
        steps = config.get("STEPS", 1)
        gate_up_rows_kernel[(n * top_k, triton.cdiv(ff, bn * steps))](
            x, ids, wg, wu, act, ff, wg.stride(0), wg.stride(1), HIDDEN=hidden, H_A=h_a, H_B=h_b, TOP_K=top_k,
            BLOCK_N=bn, STEPS=steps, num_warps=config["num_warps"], num_stages=1, **pdl)
    f_a, f_b = pieces(ff)
    bn, steps = config["DOWN_BLOCK_N"], config.get("DOWN_STEPS", 1)
    down_rows_kernel[(n, triton.cdiv(hidden, bn * steps))](
        act, ids, rw, wd, y, hidden, wd.stride(0), wd.stride(1), FF=ff, F_A=f_a, F_B=f_b, TOP_K=top_k,
        K_P2=triton.next_power_of_2(top_k), BLOCK_N=bn, STEPS=steps, num_warps=config["DOWN_WARPS"], num_stages=1,
        **pdl)
    return y
