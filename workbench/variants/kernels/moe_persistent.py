"""Triton kernel of `experts:triton_persistent`: the decode GEMVs of `experts:triton_rows` (same tiles,
same rounding) in one launch of a few programs per SM, gate/up and down apart by a grid barrier.

Why: the two row kernels stream as fast as two read-only kernels over the same bytes, so what
separates them from the bytes floor is the two launches' ramp and tail (docs/variants.md, `experts`).
Here each program walks its share of the gate/up rows (the next row's loads issued before the current
one is reduced), loads its first down rows (the routed ids are final: the router ran before this
kernel's PDL wait), then waits at the barrier for every activation, so the down phase starts with its
weights in flight instead of after a launch. In the step it is slower than the two row kernels
(docs/decisions.md #22); it stays registered and the search keeps timing it.

The barrier spins on an arrival counter, which is safe only while every program is resident at once:
the launch is cooperative (`launch_cooperative_grid`), which the driver refuses rather than running a
grid that cannot all be resident. The Triton interpreter runs programs one after another, so there
the two phases are two launches (PHASES 1, then 2) of the same code.
"""

import torch
import triton
import triton.language as tl

from workbench.variants.kernels.arrivals import arrival_counters
from workbench.variants.kernels.moe import swiglu_store
from workbench.variants.kernels.moe_rows import decode_operands, down_tiles, gate_up_tiles, pieces
from workbench.variants.kernels.triton_common import INTERPRETED, pdl_enter, pdl_launch, round_to

BOTH = 3  # PHASES: gate/up, barrier, down in one launch


@triton.jit
def _gate_up_unit(u, units, ids_ptr, wg_ptr, wu_ptr, FF, stride_we, stride_wf, BLOCKS_FF,
                  HIDDEN: tl.constexpr, H_A: tl.constexpr, H_B: tl.constexpr, BLOCK_N: tl.constexpr):
    """Unit u of the gate/up phase (a pair's block of BLOCK_N rows): its pair, rows and weight tiles,
    all masked off past the last unit."""
    live = u < units
    pair = tl.where(live, u // BLOCKS_FF, 0)
    offs_n = (u % BLOCKS_FF) * BLOCK_N + tl.arange(0, BLOCK_N)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    end = tl.where(live, FF, 0)
    ga, ua, gb, ub = gate_up_tiles(wg_ptr, wu_ptr, e, offs_n, end, stride_we, stride_wf, HIDDEN, H_A, H_B)
    return pair, offs_n, ga, ua, gb, ub


@triton.jit
def _down_unit(u, units, ids_ptr, rw_ptr, wd_ptr, HIDDEN, stride_we, stride_wh, BLOCKS_H,
               FF: tl.constexpr, F_A: tl.constexpr, F_B: tl.constexpr, TOP_K: tl.constexpr, K_P2: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Unit u of the down phase (a token's block of BLOCK_N hidden rows, all its experts): its token,
    rows, pairs, routing weights and weight tiles, masked off past the last unit."""
    live = u < units
    token = tl.where(live, u // BLOCKS_H, 0).to(tl.int64)
    offs_n = (u % BLOCKS_H) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.arange(0, K_P2)
    slot_ok = slot < TOP_K
    pairs = token * TOP_K + slot
    e = tl.load(ids_ptr + pairs, mask=slot_ok, other=0).to(tl.int64)
    rw = tl.load(rw_ptr + pairs, mask=slot_ok, other=0.0)
    rows = wd_ptr + e[:, None, None] * stride_we + offs_n[None, :, None].to(tl.int64) * stride_wh
    end = tl.where(live, HIDDEN, 0)
    wa, wb = down_tiles(rows, slot_ok[:, None, None], offs_n, end, FF, F_A, F_B)
    return token, offs_n, pairs, rw, wa, wb


@triton.jit
def experts_persistent_kernel(x_ptr, ids_ptr, rw_ptr, wg_ptr, wu_ptr, wd_ptr, act_ptr, y_ptr, sync_ptr, n_tokens,
                              stride_we, stride_wf, stride_wde, stride_wdh,
                              HIDDEN: tl.constexpr, H_A: tl.constexpr, H_B: tl.constexpr,
                              FF: tl.constexpr, F_A: tl.constexpr, F_B: tl.constexpr, TOP_K: tl.constexpr,
                              K_P2: tl.constexpr, BLOCK_N: tl.constexpr, DOWN_BLOCK_N: tl.constexpr,
                              PHASES: tl.constexpr, PDL: tl.constexpr = False):
    """act = silu(x @ gate.T) * (x @ up.T) per routed pair (PHASES & 1), then y[token] = sum_k rw *
    (act @ down.T), rounded once (PHASES & 2); program p takes units p, p + P, ... of each phase."""
    pdl_enter(PDL)  # the routed ids and x come from earlier kernels
    pid, n_prog = tl.program_id(0), tl.num_programs(0)
    blocks_h = tl.cdiv(HIDDEN, DOWN_BLOCK_N)
    units_down = n_tokens * blocks_h
    if PHASES & 1:
        blocks_ff = tl.cdiv(FF, BLOCK_N)
        units = n_tokens * TOP_K * blocks_ff
        ha = tl.arange(0, H_A)[None, :]
        hb = H_A + tl.arange(0, H_B)[None, :]
        # (tensors carried through the loops one by one, not as tuples)
        pair, offs_n, ga, ua, gb, ub = _gate_up_unit(pid, units, ids_ptr, wg_ptr, wu_ptr, FF, stride_we, stride_wf,
                                                     blocks_ff, HIDDEN, H_A, H_B, BLOCK_N)
        for u in range(pid, units, n_prog):
            # the next unit's rows go out before this one is reduced (masked off past the last)
            next_pair, next_offs, nga, nua, ngb, nub = _gate_up_unit(u + n_prog, units, ids_ptr, wg_ptr, wu_ptr, FF,
                                                                     stride_we, stride_wf, blocks_ff, HIDDEN, H_A,
                                                                     H_B, BLOCK_N)
            x_row = x_ptr + (pair // TOP_K).to(tl.int64) * HIDDEN
            xa = tl.load(x_row + ha).to(tl.float32)
            xb = tl.load(x_row + hb, mask=hb < HIDDEN, other=0.0).to(tl.float32)
            g = tl.sum(ga.to(tl.float32) * xa, axis=1) + tl.sum(gb.to(tl.float32) * xb, axis=1)
            up = tl.sum(ua.to(tl.float32) * xa, axis=1) + tl.sum(ub.to(tl.float32) * xb, axis=1)
            swiglu_store(g, up, act_ptr + pair.to(tl.int64) * FF + offs_n, offs_n < FF)
            pair, offs_n, ga, ua, gb, ub = next_pair, next_offs, nga, nua, ngb, nub
    if PHASES & 2:
        # the first down rows before the barrier: they depend on the routed ids only
        token, offs_n, pairs, rw, wa, wb = _down_unit(pid, units_down, ids_ptr, rw_ptr, wd_ptr, HIDDEN, stride_wde,
                                                      stride_wdh, blocks_h, FF, F_A, F_B, TOP_K, K_P2, DOWN_BLOCK_N)
    if PHASES == 3:
        # Grid barrier: every thread's activations are stored before the count moves (CTA barrier, then
        # a release at GPU scope); each program then spins until all have counted (acquire)
        tl.debug_barrier()
        count = tl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu") + 1
        while count < n_prog:
            count = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    if PHASES & 2:
        slot_ok = tl.arange(0, K_P2) < TOP_K
        fa = tl.arange(0, F_A)[None, :]
        fb = F_A + tl.arange(0, F_B)[None, :]
        for u in range(pid, units_down, n_prog):
            n_token, n_offs, n_pairs, n_rw, nwa, nwb = _down_unit(u + n_prog, units_down, ids_ptr, rw_ptr, wd_ptr,
                                                                  HIDDEN, stride_wde, stride_wdh, blocks_h, FF, F_A,
                                                                  F_B, TOP_K, K_P2, DOWN_BLOCK_N)
            # activations from L2 (".cg"): other programs of this launch wrote them
            a_rows = act_ptr + pairs[:, None] * FF
            aa = tl.load(a_rows + fa, mask=slot_ok[:, None], other=0.0, cache_modifier=".cg")
            ab = tl.load(a_rows + fb, mask=slot_ok[:, None] & (fb < FF), other=0.0, cache_modifier=".cg")
            acc = tl.sum(wa.to(tl.float32) * aa.to(tl.float32)[:, None, :], axis=2) \
                + tl.sum(wb.to(tl.float32) * ab.to(tl.float32)[:, None, :], axis=2)
            y = round_to(tl.sum(acc * rw[:, None], axis=0), y_ptr.dtype.element_ty)
            tl.store(y_ptr + token * HIDDEN + offs_n, y, mask=offs_n < HIDDEN)
            token, offs_n, pairs, rw, wa, wb = n_token, n_offs, n_pairs, n_rw, nwa, nwb
    if PHASES == 3:
        # The last program past its down rows resets the barrier for the next launch: every program
        # has left the spin by then
        if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == n_prog - 1:
            tl.atomic_xchg(sync_ptr, 0)
            tl.atomic_xchg(sync_ptr + 1, 0)


def programs(device: torch.device, per_sm: int) -> int:
    """The persistent grid: `per_sm` programs on each SM (4 "SMs" under the CPU interpreter)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return sms * per_sm


def fused_experts_persistent(x, ids, weights, w, config: dict):
    """The `experts` contract for a few routed pairs (decode) in one launch; `config`: BLOCK_N, DOWN_BLOCK_N,
    num_warps, PER_SM, optional pdl."""
    wg, wu, wd, x, ids, rw, y, act = decode_operands(x, ids, weights, w, "experts:triton_persistent")
    n, top_k = ids.shape
    ff, hidden = wg.shape[1], wg.shape[2]
    if n == 0:
        return y
    sync = arrival_counters(2, x.device, "experts_persistent")
    (h_a, h_b), (f_a, f_b) = pieces(hidden), pieces(ff)
    grid = (programs(x.device, config["PER_SM"]),)
    args = (x, ids, rw, wg, wu, wd, act, y, sync, n, wg.stride(0), wg.stride(1), wd.stride(0), wd.stride(1))
    consts = dict(HIDDEN=hidden, H_A=h_a, H_B=h_b, FF=ff, F_A=f_a, F_B=f_b, TOP_K=top_k,
                  K_P2=triton.next_power_of_2(top_k), BLOCK_N=config["BLOCK_N"], DOWN_BLOCK_N=config["DOWN_BLOCK_N"],
                  num_warps=config["num_warps"], num_stages=1, **pdl_launch(config.get("pdl")))
    if INTERPRETED:  # programs run one after another: no barrier, two launches
        experts_persistent_kernel[grid](*args, PHASES=1, **consts)
        experts_persistent_kernel[grid](*args, PHASES=2, **consts)
    else:
        experts_persistent_kernel[grid](*args, PHASES=BOTH, launch_cooperative_grid=True, **consts)
    return y
