"""Triton kernels of `experts:triton_rows`: the decode GEMV path of `experts:triton` (`_triton_moe.py`),
with each program's weight rows loaded whole, in one step, instead of in a loop of BLOCK_K slices.

Why: at decode batch 1 (beam-501b-tp8) the GEMV kernels stream 80 MB a layer at ~60% of the copy
bandwidth, and the search showed their speed follows the number of serial load steps per program,
not the bytes each program moves: halving gate/up's slice (8 x 256, 20 steps) cost ~11 us a layer
against 8 x 512 (runs/optimize-decode-b1-beam-501b-tp8/search/experts.json), software pipelining
(num_stages 2-3) did not take effect on these loads, and wider slices spilled registers
(runs/experts-sweep-tp8-b1/, runs/sm90-resources-experts/). Here a program issues every load of its
rows at once and then reduces, so each waits on memory once; fewer rows per program keep the tile
in registers (more, smaller programs instead of longer loops).

A row's length is split into two power-of-two pieces loaded side by side (hidden 5120 = 4096 + 1024,
ff 320 = 256 + 64 at TP8; the second masked when the rest is not a power of two), so no lane is
padding. Summation order is fixed (no atomics): results are bitwise reproducible; the activation is
rounded once, the top_k combine is FP32 and rounded once, as in `_triton_moe.py`'s GEMV path.
"""

import torch
import triton
import triton.language as tl

from workbench.variants._triton_common import pdl_enter, pdl_launch, round_to
from workbench.variants._triton_moe import _gate_up_gemv, _swiglu_store

# Registers: a config is only run where each thread's share of the largest tile (bf16 weight elements)
# stays under this; past it the kernel spills and streams slower (runs/sm90-resources-experts/).
MAX_ELEMENTS_PER_THREAD = 128


def pieces(n: int) -> tuple[int, int]:
    """`n` as a power of two plus the power of two covering the rest (0 if none): 5120 -> (4096, 1024)."""
    a = 1 << (n.bit_length() - 1)
    return a, (triton.next_power_of_2(n - a) if n > a else 0)


@triton.jit
def _gate_up_rows(x_ptr, ids_ptr, wg_ptr, wu_ptr, act_ptr, FF, stride_we, stride_wf,
                  HIDDEN: tl.constexpr, H_A: tl.constexpr, H_B: tl.constexpr, TOP_K: tl.constexpr,
                  BLOCK_N: tl.constexpr, PDL: tl.constexpr = False):
    """act[pair, n-block] = silu(x[token] @ gate[e].T) * (x[token] @ up[e].T), e = ids[pair]: BLOCK_N
    whole rows of gate and of up per program, every load issued before the first FMA."""
    pdl_enter(PDL)  # the routed ids (and x) come from earlier kernels
    pair = tl.program_id(0)
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * HIDDEN
    e = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < FF
    rows = e * stride_we + offs_n[:, None].to(tl.int64) * stride_wf
    ha = tl.arange(0, H_A)[None, :]
    ga = tl.load(wg_ptr + rows + ha, mask=n_ok[:, None], other=0.0)
    ua = tl.load(wu_ptr + rows + ha, mask=n_ok[:, None], other=0.0)
    xa = tl.load(x_row + ha)
    if H_B > 0:  # constexpr: the rest of each row, loaded before piece A is reduced
        hb = H_A + tl.arange(0, H_B)[None, :]
        b_ok = n_ok[:, None] & (hb < HIDDEN)
        gb = tl.load(wg_ptr + rows + hb, mask=b_ok, other=0.0)
        ub = tl.load(wu_ptr + rows + hb, mask=b_ok, other=0.0)
        xb = tl.load(x_row + hb, mask=hb < HIDDEN, other=0.0)
    g = tl.sum(ga.to(tl.float32) * xa.to(tl.float32), axis=1)
    u = tl.sum(ua.to(tl.float32) * xa.to(tl.float32), axis=1)
    if H_B > 0:
        g += tl.sum(gb.to(tl.float32) * xb.to(tl.float32), axis=1)
        u += tl.sum(ub.to(tl.float32) * xb.to(tl.float32), axis=1)
    _swiglu_store(g, u, act_ptr + pair.to(tl.int64) * FF + offs_n, n_ok)


@triton.jit
def _down_rows(act_ptr, ids_ptr, rw_ptr, wd_ptr, y_ptr, HIDDEN, stride_we, stride_wh,
               FF: tl.constexpr, F_A: tl.constexpr, F_B: tl.constexpr, TOP_K: tl.constexpr,
               K_P2: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False):
    """y[token, n-block] = sum_k rw[token, k] * (act[token, k] @ down[ids[token, k]].T), rounded once:
    BLOCK_N whole rows of each of the token's top_k experts per program, loaded at once."""
    pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.arange(0, K_P2)
    slot_ok = slot < TOP_K
    pairs = token * TOP_K + slot
    e = tl.load(ids_ptr + pairs, mask=slot_ok, other=0).to(tl.int64)
    rw = tl.load(rw_ptr + pairs, mask=slot_ok, other=0.0)
    rows = wd_ptr + e[:, None, None] * stride_we + offs_n[None, :, None].to(tl.int64) * stride_wh
    w_ok = slot_ok[:, None, None] & (offs_n < HIDDEN)[None, :, None]
    a_rows = act_ptr + pairs[:, None] * FF
    fa = tl.arange(0, F_A)
    wa = tl.load(rows + fa[None, None, :], mask=w_ok, other=0.0)
    aa = tl.load(a_rows + fa[None, :], mask=slot_ok[:, None], other=0.0)
    if F_B > 0:
        fb = F_A + tl.arange(0, F_B)
        fb_ok = fb < FF
        wb = tl.load(rows + fb[None, None, :], mask=w_ok & fb_ok[None, None, :], other=0.0)
        ab = tl.load(a_rows + fb[None, :], mask=slot_ok[:, None] & fb_ok[None, :], other=0.0)
    # the routing weight scales the activation, as in `_triton_moe._down_gemv`
    acc = tl.sum(wa.to(tl.float32) * (aa.to(tl.float32) * rw[:, None])[:, None, :], axis=2)
    if F_B > 0:
        acc += tl.sum(wb.to(tl.float32) * (ab.to(tl.float32) * rw[:, None])[:, None, :], axis=2)
    y = round_to(tl.sum(acc, axis=0), y_ptr.dtype.element_ty)
    tl.store(y_ptr + token * HIDDEN + offs_n, y, mask=offs_n < HIDDEN)


def elements_per_thread(config: dict, hidden: int, ff: int, top_k: int) -> int:
    """The larger of the two kernels' bf16 weight elements per thread at this config (register use)."""
    row = config.get("BLOCK_K") or sum(pieces(hidden))  # BLOCK_K: the looped kernel's slice
    gate_up = 2 * config["BLOCK_N"] * row // (32 * config["num_warps"])
    down = triton.next_power_of_2(top_k) * config["DOWN_BLOCK_N"] * sum(pieces(ff)) // (32 * config["DOWN_WARPS"])
    return max(gate_up, down)


def fused_experts_rows(x, ids, weights, w, config: dict):
    """The `experts` contract for a few routed pairs (decode); `config` is one of the variant's."""
    wg, wu, wd = w["gate_proj"], w["up_proj"], w["down_proj"]
    n, top_k = ids.shape
    _, ff, hidden = wg.shape
    if not (wg.stride(-1) == wu.stride(-1) == wd.stride(-1) == 1 and wg.stride() == wu.stride()):
        raise ValueError("experts:triton_rows needs weights contiguous along their last dim, gate/up alike")
    x, ids, rw = x.contiguous(), ids.contiguous(), weights.contiguous().float()
    y = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    act = torch.empty(n * top_k, ff, dtype=x.dtype, device=x.device)
    pdl = pdl_launch(config.get("pdl"))
    bn = config["BLOCK_N"]
    if "BLOCK_K" in config:  # experts:triton's looped gate/up GEMV: times the new down kernel alone
        _gate_up_gemv[(n * top_k, triton.cdiv(ff, bn), 1)](
            x, ids, wg, wu, act, act, act, hidden, ff, triton.cdiv(hidden, config["BLOCK_K"]) * config["BLOCK_K"],
            wg.stride(0), wg.stride(1), TOP_K=top_k, BLOCK_N=bn, BLOCK_K=config["BLOCK_K"], SPLIT=1,
            num_warps=config["num_warps"], num_stages=1, **pdl)
    else:
        h_a, h_b = pieces(hidden)
        _gate_up_rows[(n * top_k, triton.cdiv(ff, bn))](
            x, ids, wg, wu, act, ff, wg.stride(0), wg.stride(1), HIDDEN=hidden, H_A=h_a, H_B=h_b, TOP_K=top_k,
            BLOCK_N=bn, num_warps=config["num_warps"], num_stages=1, **pdl)
    f_a, f_b = pieces(ff)
    bn = config["DOWN_BLOCK_N"]
    _down_rows[(n, triton.cdiv(hidden, bn))](
        act, ids, rw, wd, y, hidden, wd.stride(0), wd.stride(1), FF=ff, F_A=f_a, F_B=f_b, TOP_K=top_k,
        K_P2=triton.next_power_of_2(top_k), BLOCK_N=bn, num_warps=config["DOWN_WARPS"], num_stages=1, **pdl)
    return y
