"""`route:triton`: a batch-size-specialised FP32 router GEMM, then one selection kernel.

Two launches per call, as in the published design ("Fused FP32 routing"), or one (fused_select configs:
at N <= 16 the GEMV's last program to finish runs the selection):
 1. the router GEMM in FP32, one of three regimes picked from the token count N (a shape, so the
    choice is fixed inside a CUDA graph):
      N <= 16   `_route_gemv`: FP32 CUDA cores; a program owns BLOCK_E experts x one K slice and
                reads that weight tile once for all N tokens; split over experts and K so the
                256 x 5120 FP32 weight (5.2 MB) streams from a few hundred CTAs at once.
      N <= 96   `_route_mm` FP32 tiles: tl.dot in IEEE FP32 (CUDA-core FMAs, never TF32).
      N > 96    `_route_mm` BF16x3: tensor cores on the exact split W = w1 + w2 + w3 (BF16 each,
                made once in `prepare`); x split the same way (1 piece for BF16 x, 2 for FP16, 3
                for FP32); FP32 accumulation.
    Every GEMM writes FP32 partial sums [SPLIT, N, E]: split-K without atomics, so the result is
    deterministic and no zero-fill launch is needed.
 2. `route_select` (`kernels/route_select.py`), one program per select_tokens tokens (one at N = 1):
    the noaux_tc selection over the summed partials, all in FP32.
Configs tune block sizes, split-K and warps per regime; the thresholds 16 / 96 are the published ones
(docs/decisions.md #27).

Imports without triton (`triton_common.jit` leaves plain functions): the variant is registered either
way and the registry reports the backend as unavailable.
"""

import os

import torch

from workbench.registry import register
from workbench.variants.kernels.arrivals import arrival_counters
from workbench.variants.kernels.route_select import (
    group_tile,
    prepare_router,
    route_select,
    select_args,
    select_experts,
)
from workbench.variants.kernels.triton_common import jit as _jit
from workbench.variants.kernels.triton_common import pdl_enter, pdl_launch, pow2, tl, triton

ROUTE_GEMV_MAX = 16   # tokens: up to here the FP32 GEMV
ROUTE_FP32_MAX = 96   # tokens: up to here FP32 tiles; above, tensor cores on the BF16x3 split
_TARGET_CTAS = 264    # 2 CTAs per SM on H200's 132 SMs: tiled regimes split K only up to this many CTAs


@_jit
def _route_gemv(x_ptr, w_ptr, part_ptr, N, E, K, K_PER_SPLIT,
                bias_ptr, ids_ptr, wts_ptr, count_ptr, EPG, scale,
                BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, FUSED: tl.constexpr,
                SPLIT: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_J: tl.constexpr, KEYED: tl.constexpr = False,
                PDL: tl.constexpr = False):
    """Router logits for N <= 16 tokens on FP32 CUDA cores: part[s, n, e] = x[n, Ks] . W[e, Ks].

    Products accumulate element-wise in a [BLOCK_N, BLOCK_E, BLOCK_K] register tile and are reduced
    over K once at the end, so the loop is pure loads + FMAs (no shuffles per step). FUSED: the
    program that stores the last partials (an arrival counter, `kernels/arrivals.py`) runs the selection of
    every token, so a decode step routes in one launch instead of two."""
    pid_e, pid_s = tl.program_id(0), tl.program_id(1)
    offs_n = tl.arange(0, BLOCK_N)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    k_lo = pid_s * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_N, BLOCK_E, BLOCK_K), tl.float32)
    if PDL:  # the weight is never written: its first tile is read while the previous kernel finishes
        offs_k = k_lo + tl.arange(0, BLOCK_K)
        w_first = tl.load(w_ptr + offs_e[:, None] * K + offs_k[None, :],
                          mask=(offs_e[:, None] < E) & (offs_k < k_hi)[None, :], other=0.0)
    pdl_enter(PDL)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < k_hi
        if PDL and k0 == k_lo:
            w = w_first
        else:
            w = tl.load(w_ptr + offs_e[:, None] * K + offs_k[None, :],
                        mask=(offs_e[:, None] < E) & in_k[None, :], other=0.0)
        x = tl.load(x_ptr + offs_n[:, None] * K + offs_k[None, :],
                    mask=(offs_n[:, None] < N) & in_k[None, :], other=0.0).to(tl.float32)
        acc += x[:, None, :] * w[None, :, :]
    out = tl.sum(acc, axis=2)
    tl.store(part_ptr + (pid_s * N + offs_n[:, None]) * E + offs_e[None, :], out,
             mask=(offs_n[:, None] < N) & (offs_e[None, :] < E))
    if FUSED:
        # Every thread's stores above come before the count moves (barrier, then a release); the last
        # program acquires them all, selects, and leaves the counter at 0 again.
        tl.debug_barrier()
        if tl.atomic_add(count_ptr, 1, sem="acq_rel") == tl.num_programs(0) * tl.num_programs(1) - 1:
            select_experts(tl.arange(0, BLOCK_T), part_ptr, group_tile(bias_ptr, EPG, N_GROUP, BLOCK_G, BLOCK_J),
                           ids_ptr, wts_ptr, N, E, EPG, scale, tl.num_programs(1), SPLIT, N_GROUP, TOPK_GROUP, TOP_K,
                           BLOCK_T, BLOCK_G, BLOCK_J, KEYED, ".cg")
            tl.atomic_xchg(count_ptr, 0)


@_jit
def _route_mm(x_ptr, w_ptr, part_ptr, N, E, K, K_PER_SPLIT,
              BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
              BF16X3: tl.constexpr, X_PIECES: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr = False):
    """Router logits as tiles: part[s, tile] = x[tile, Ks] @ W[tile, Ks]^T, accumulated in FP32.

    BF16X3=False: W FP32 [E, K], tl.dot in IEEE FP32 (CUDA cores; TF32 would lose 13 bits).
    BF16X3=True: W is the [3, E, K] BF16 split; x is split into X_PIECES BF16 pieces in registers and
    the pieces' products are summed on tensor cores. With BF16 x every product is exact; with FP16 /
    FP32 x the pairs (x_i, w_j) with i + j > 2 are dropped: each is < 2^-24 |x||w|, below FP32 rounding.
    DOT is tl.bfloat16 on the GPU, tl.float32 under the interpreter (whose BF16 tl.dot multiplies the
    raw bits); a product of two BF16 values is exact in FP32, so both compute the same sums.

    PDL waits at the top: reading a weight tile before the wait would put the loop's weight load under
    an `if`, which the pipeliner skips, and at N > 16 there is little launch gap to hide."""
    pdl_enter(PDL)
    pid_m, pid_e, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    k_lo = pid_s * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_E), tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < k_hi
        x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :],
                    mask=(offs_m[:, None] < N) & in_k[None, :], other=0.0).to(tl.float32)
        w_offs = offs_e[None, :] * K + offs_k[:, None]  # W^T tile [BLOCK_K, BLOCK_E]
        w_mask = (offs_e[None, :] < E) & in_k[:, None]
        if BF16X3:
            w1 = tl.load(w_ptr + w_offs, mask=w_mask, other=0.0).to(DOT)
            w2 = tl.load(w_ptr + E * K + w_offs, mask=w_mask, other=0.0).to(DOT)
            w3 = tl.load(w_ptr + 2 * E * K + w_offs, mask=w_mask, other=0.0).to(DOT)
            x1 = x.to(tl.bfloat16)
            # Smallest terms first, so they are not absorbed by a large partial sum.
            acc = tl.dot(x1.to(DOT), w3, acc)
            if X_PIECES >= 2:
                r = x - x1.to(tl.float32)
                x2 = r.to(tl.bfloat16)
                if X_PIECES >= 3:
                    acc = tl.dot((r - x2.to(tl.float32)).to(tl.bfloat16).to(DOT), w1, acc)
                acc = tl.dot(x2.to(DOT), w2, acc)
                acc = tl.dot(x2.to(DOT), w1, acc)
            acc = tl.dot(x1.to(DOT), w2, acc)
            acc = tl.dot(x1.to(DOT), w1, acc)
        else:
            w = tl.load(w_ptr + w_offs, mask=w_mask, other=0.0)
            acc = tl.dot(x, w, acc, input_precision="ieee")
    tl.store(part_ptr + (pid_s * N + offs_m[:, None]) * E + offs_e[None, :], acc,
             mask=(offs_m[:, None] < N) & (offs_e[None, :] < E))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _split_k(k: int, block_k: int, split: int) -> tuple[int, int]:
    """(splits, K per split): K per split a multiple of block_k, and no split left empty."""
    k_tiles = triton.cdiv(k, block_k)
    per = triton.cdiv(k_tiles, max(1, min(split, k_tiles)))
    return triton.cdiv(k_tiles, per), per * block_k


CONFIGS = [
    # gemv_*: N <= 16; a program reads block_e experts x (K / split) of W (gemv_block_k per step at
    # N = 1, shrunk as N grows so the register tile stays the same size). fp32_*: N <= 96; tc_*:
    # N > 96 (split = most K slices, used only while the output tiles alone cannot fill the GPU).
    # select_*: tokens per program, and warps at that many tokens (fewer tokens, fewer warps: at one
    # token a single warp does the 2 * top_k + 2 * topk_group + 5 reductions with shuffles only).
    # fused_select: at N <= 16 the GEMV's last program to finish selects (no second launch).
    # select_keys: the selection's KEYED form (top_k + 5 reductions, see `select_experts`); absent: False.
    dict(gemv_block_e=4, gemv_block_k=1024, gemv_split=5, gemv_warps=4,  # 320 CTAs x 16 KB at 256 x 5120
         fp32_block_m=32, fp32_block_e=64, fp32_block_k=32, fp32_split=16, fp32_warps=4,
         tc_block_m=64, tc_block_e=64, tc_block_k=64, tc_split=8, tc_warps=4, tc_stages=3,
         select_tokens=4, select_warps=4, fused_select=False),
    dict(gemv_block_e=1, gemv_block_k=1024, gemv_split=1, gemv_warps=4,  # published: one CTA per expert
         fp32_block_m=16, fp32_block_e=64, fp32_block_k=64, fp32_split=16, fp32_warps=4,
         tc_block_m=64, tc_block_e=128, tc_block_k=64, tc_split=8, tc_warps=8, tc_stages=3,
         select_tokens=8, select_warps=8, fused_select=False),
    # (No 20-way split with gemv_block_e=16 / gemv_block_k=256 / select_tokens=2: it gives NaN weights
    # at 8 tokens on the H200 under Triton 3.6 while passing interpreted; the op gate rejects it there.)
    dict(gemv_block_e=8, gemv_block_k=512, gemv_split=10, gemv_warps=4,
         fp32_block_m=64, fp32_block_e=64, fp32_block_k=16, fp32_split=8, fp32_warps=8,
         tc_block_m=128, tc_block_e=128, tc_block_k=64, tc_split=16, tc_warps=8, tc_stages=3,
         select_tokens=16, select_warps=16, fused_select=False),
]
CONFIGS += [
    # the first, with the selection run by the GEMV's last program at N <= 16: one launch a decode step
    dict(CONFIGS[0], fused_select=True),
    # the same with half the GEMV programs (160), so half the arrivals on the one counter (the first's
    # 320 programs all count on a single address; docs/decisions.md #22)
    dict(CONFIGS[0], gemv_block_e=8, gemv_block_k=512, fused_select=True),
    # the decode lock's config (the first) with the keyed selection, in its own launch and fused
    dict(CONFIGS[0], select_keys=True),
    dict(CONFIGS[0], fused_select=True, select_keys=True),
]


def _route_gemv_launch(x, w, cfg, select):
    """The GEMV regime: partial logits [SPLIT, N, E]; with `select` (the selection's outputs and
    settings), the last program also selects (fused_select configs)."""
    n, k = x.shape
    e = w["weight"].shape[0]
    block_n = pow2(n)
    # Keep the register tile BLOCK_N x BLOCK_E x BLOCK_K near the N = 1 size as N grows.
    block_k = max(16, cfg["gemv_block_k"] // block_n)
    split, per = _split_k(k, block_k, cfg["gemv_split"])
    part = torch.empty((split, n, e), dtype=torch.float32, device=x.device)
    if select is None:  # placeholders for the pointers and sizes the unfused kernel never reads
        outs, sizes, consts = (part, part, part), (0, 0, 0.0, 1), dict(SPLIT=1, N_GROUP=1, TOPK_GROUP=1, TOP_K=1,
                                                                     BLOCK_T=1, BLOCK_G=1, BLOCK_J=1, KEYED=False)
        count = part
    else:
        outs, sizes, consts = select_args(part, w, *select)
        count = arrival_counters(1, x.device, "route")
    _route_gemv[(triton.cdiv(e, cfg["gemv_block_e"]), split)](
        x, w["weight"], part, n, e, k, per, *outs, count, *sizes[1:3], BLOCK_N=block_n, BLOCK_E=cfg["gemv_block_e"],
        BLOCK_K=block_k, FUSED=select is not None, **consts, num_warps=cfg["gemv_warps"], **pdl_launch(cfg.get("pdl")))
    return part


def _route_logits(x, w, cfg):
    """FP32 partial logits [SPLIT, N, E] for the regime N falls in, and the most partials that regime
    makes at any N (the selection's compile-time bound)."""
    n, k = x.shape
    e = w["weight"].shape[0]
    if n <= ROUTE_GEMV_MAX:
        part = _route_gemv_launch(x, w, cfg, None)
        return part, part.shape[0]  # the config's split of K, whatever N
    tc = n > ROUTE_FP32_MAX
    p = "tc_" if tc else "fp32_"
    bm, be, bk = cfg[p + "block_m"], cfg[p + "block_e"], cfg[p + "block_k"]
    tiles = triton.cdiv(n, bm) * triton.cdiv(e, be)
    split, per = _split_k(k, bk, min(cfg[p + "split"], max(1, triton.cdiv(_TARGET_CTAS, tiles))))
    part = torch.empty((split, n, e), dtype=torch.float32, device=x.device)
    pieces = {torch.bfloat16: 1, torch.float16: 2}.get(x.dtype, 3)
    _route_mm[(triton.cdiv(n, bm), triton.cdiv(e, be), split)](
        x, w["bf16x3"] if tc else w["weight"], part, n, e, k, per, BLOCK_M=bm, BLOCK_E=be, BLOCK_K=bk,
        BF16X3=tc, X_PIECES=pieces, DOT=tl.float32 if _interpreting() else tl.bfloat16,
        num_warps=cfg[p + "warps"], num_stages=cfg.get(p + "stages", 2), **pdl_launch(cfg.get("pdl")))
    return part, cfg[p + "split"]


def route_triton_at(cfg):
    def route_triton(x, w, *, n_group, topk_group, top_k, scale):
        x = x.contiguous()
        n = x.shape[0]
        ids = torch.empty((n, top_k), dtype=torch.int64, device=x.device)
        weights = torch.empty((n, top_k), dtype=torch.float32, device=x.device)
        if n == 0:
            return ids, weights
        keyed = cfg.get("select_keys", False)
        # Never 2 tokens per program: at BLOCK_T = 2 the compiled selection picks wrong experts on the
        # H200 under Triton 3.6 (it passes interpreted); 1 (decode) and >= 4 pass the gates there.
        if cfg["fused_select"] and n <= ROUTE_GEMV_MAX:  # one program selects every token
            block_t = 1 if n == 1 else max(4, pow2(n))
            _route_gemv_launch(x, w, cfg, (ids, weights, n_group, topk_group, top_k, scale, block_t, None, keyed))
            return ids, weights
        part, max_split = _route_logits(x, w, cfg)
        block_t = 1 if n == 1 else max(min(4, cfg["select_tokens"]), min(cfg["select_tokens"], pow2(n)))
        outs, sizes, consts = select_args(part, w, ids, weights, n_group, topk_group, top_k, scale, block_t,
                                           max_split, keyed)
        route_select[(triton.cdiv(n, block_t),)](
            part, *outs, n, *sizes, **consts, num_warps=max(1, cfg["select_warps"] * block_t // cfg["select_tokens"]),
            **pdl_launch(cfg.get("pdl")))
        return ids, weights

    return route_triton


def _supports(wl):
    c = wl.config
    if wl.dtype not in ("bf16", "fp16", "fp32"):
        return f"route:triton takes bf16/fp16/fp32 activations, not {wl.dtype}"
    if c.n_routed_experts % c.n_group or c.n_routed_experts // c.n_group < 2:
        return "route:triton needs equal expert groups of at least 2 experts"
    if c.num_experts_per_tok > 64 or c.n_routed_experts > 4096:
        return "route:triton's selection kernel unrolls top_k rounds and holds all experts in registers: " \
               "top_k <= 64 and experts <= 4096"
    return True


register("route", "triton", "triton", prepare=prepare_router, supports=_supports,
         configs=CONFIGS, pdl=True, configure=route_triton_at)(route_triton_at(CONFIGS[0]))
