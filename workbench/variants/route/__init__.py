"""`route`: DeepSeek-V3 `noaux_tc` routing in FP32.

Contract: `route(x, w, *, n_group, topk_group, top_k, scale) -> (ids, weights)`.
- x [N, hidden] model dtype; w {"weight": [experts, hidden] FP32, "bias": [experts] FP32}.
- logits = x.float() @ weight.T (FP32); s = sigmoid(logits); selection on s + bias: experts form
  n_group groups, a group scores the sum of its top-2 biased scores, the best topk_group groups
  stay, then the top_k experts among them. Weights are the *unbiased* s at those experts,
  renormalised to sum 1, times `scale`.
- ids [N, top_k] int64 (order free: gates compare sets), weights [N, top_k] FP32 aligned with ids.
"""

import itertools

import torch

from workbench.points import Call, PointSpec, declare
from workbench.registry import register
from workbench.variants.inputs import DTYPE_BYTES, Rand


@register("route", "torch", "torch")
def route(x, w, *, n_group, topk_group, top_k, scale):
    scores = torch.sigmoid(x.float() @ w["weight"].float().t())
    biased = scores + w["bias"].float()
    n, experts = biased.shape
    group_scores = biased.view(n, n_group, -1).topk(2, dim=-1).values.sum(-1)
    kept_groups = group_scores.topk(topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    expert_mask = group_mask.repeat_interleave(experts // n_group, dim=1)
    ids = biased.masked_fill(~expert_mask, float("-inf")).topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    return ids, weights / weights.sum(-1, keepdim=True) * scale


# ---- spec: inputs, roofline and tolerance for the harness ------------------------------------------

# Biased scores closer than this (in the FP64 recomputation) are a genuine tie: FP32 summation
# order alone can flip them, so either choice is right. FP32 router logits at hidden 5120 carry
# errors ~1e-6; a router computed in BF16/TF32 errs ~1e-3 and is caught.
TIE_EPS = 1e-5


def _inputs(wl, device, seed):
    c, r = wl.config, Rand("route", wl, device, seed)
    w = {"weight": r.linear(c.n_routed_experts, c.hidden_size, dtype=torch.float32),
         "bias": r.normal(c.n_routed_experts, std=0.05, dtype=torch.float32)}
    kw = dict(n_group=c.n_group, topk_group=c.topk_group, top_k=c.num_experts_per_tok, scale=c.routed_scaling_factor)
    return Call((r.normal(wl.tokens, c.hidden_size), w), kw, weights_arg=1)


def _valid_choice(biased, ids, n_group, topk_group, top_k):
    """Whether `ids` is the noaux_tc choice for one row of FP64 biased scores, up to ties within TIE_EPS.

    The ids' own groups must be kept; when they span fewer than topk_group groups, any fill of the
    remaining kept groups that is itself a valid group choice will do (two groups scoring within
    TIE_EPS are a tie: a variant may keep either, and only the kept groups' experts compete)."""
    experts = biased.shape[0]
    size = experts // n_group
    if len(set(ids)) != top_k or not all(0 <= e < experts for e in ids):
        return False
    group_scores = biased.view(n_group, size).topk(2, dim=-1).values.sum(-1)
    groups = sorted({e // size for e in ids})
    if len(groups) > topk_group:
        return False
    rest = [g for g in range(n_group) if g not in groups]
    for fill in itertools.combinations(rest, topk_group - len(groups)):
        kept = groups + list(fill)
        dropped = [g for g in rest if g not in fill]
        if dropped and group_scores[kept].min() < group_scores[dropped].max() - TIE_EPS:
            continue
        others = [e for g in kept for e in range(g * size, (g + 1) * size) if e not in ids]
        if not others or biased[ids].min() >= biased[others].max() - TIE_EPS:
            return True
    return False


def _compare(call, out, ref, tol, run=None):
    """Id sets exact per token (ties within TIE_EPS aside); weights per id against FP64."""
    x, w = call.args
    ids, weights = out
    if ids.dtype != torch.int64 or weights.dtype != torch.float32:
        return [("route_ids", None, None, False, f"ids {ids.dtype}, weights {weights.dtype}: want int64, float32")]
    scores = torch.sigmoid(x.double() @ w["weight"].double().t()).cpu()
    biased = scores + w["bias"].double().cpu()
    got, want = ids.cpu(), ref[0].cpu()
    differ = (got.sort(-1).values != want.sort(-1).values).any(-1).nonzero().flatten().tolist()
    kw = {k: call.kwargs[k] for k in ("n_group", "topk_group", "top_k")}
    wrong = [n for n in differ if not _valid_choice(biased[n], got[n].tolist(), **kw)]
    # Expected weights at the candidate's own ids, so rows that differ by a tie are checked too.
    picked = scores.gather(1, got.clamp(0, scores.shape[1] - 1))
    expected = picked / picked.sum(-1, keepdim=True) * call.kwargs["scale"]
    err = ((weights.cpu().double() - expected).norm() / expected.norm()).item()
    return [("route_ids", float(len(wrong)), 0.0, not wrong,
             f"tokens {wrong[:8]} pick other experts" if wrong else f"{len(differ)} token(s) differ by a tie"),
            ("route_weights", err, tol, err <= tol, "weights at the chosen ids vs FP64")]


def _bytes(wl):
    c, n = wl.config, wl.tokens
    return DTYPE_BYTES[wl.dtype] * n * c.hidden_size + 4 * c.n_routed_experts * (c.hidden_size + 1) \
        + 12 * n * c.num_experts_per_tok


# Routing is FP32 whatever the model dtype: one tolerance for all.
declare(PointSpec(
    "route", _inputs, bytes=_bytes,
    flops=lambda wl: 2 * wl.tokens * wl.config.hidden_size * wl.config.n_routed_experts,
    tolerance={"fp32": 1e-5, "fp16": 1e-5, "bf16": 1e-5},
    compare=_compare,
))


# ---- triton: batch-size-specialised FP32 router GEMM + one fused selection kernel ----------------
#
# Two launches per call, as in the published design ("Fused FP32 routing"), or one (fused_select configs:
# at N <= 16 the GEMV's last program to finish runs the selection):
#  1. the router GEMM in FP32, one of three regimes picked from the token count N (a shape, so the
#     choice is fixed inside a CUDA graph):
#       N <= 16   `_route_gemv`: FP32 CUDA cores; a program owns BLOCK_E experts x one K slice and
#                 reads that weight tile once for all N tokens; split over experts and K so the
#                 256 x 5120 FP32 weight (5.2 MB) streams from a few hundred CTAs at once.
#       N <= 96   `_route_mm` FP32 tiles: tl.dot in IEEE FP32 (CUDA-core FMAs, never TF32).
#       N > 96    `_route_mm` BF16x3: tensor cores on the exact split W = w1 + w2 + w3 (BF16 each,
#                 made once in `prepare`); x split the same way (1 piece for BF16 x, 2 for FP16, 3
#                 for FP32); FP32 accumulation.
#     Every GEMM writes FP32 partial sums [SPLIT, N, E]: split-K without atomics, so the result is
#     deterministic and no zero-fill launch is needed.
#  2. `_route_select`, one program per select_tokens tokens (one at N = 1): sums the partials in a
#     fixed order, then sigmoid, bias, group top-2 sums, top groups, top-k experts and renormalised
#     weights * scale, all in FP32. Ids come out in ascending expert order (the contract's order is
#     free). Tie order (exact ties only): lowest group index, then lowest expert index, first.
# Configs tune block sizes, split-K and warps per regime; the thresholds 16 / 96 are the published ones.

import os

from workbench.variants.kernels.arrivals import arrival_counters  # noqa: E402
from workbench.variants.kernels.triton_common import jit as _jit, pdl_enter, pdl_launch, tl, triton  # noqa: E402

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
    program that stores the last partials (an arrival counter, `_arrivals.py`) runs the selection of
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
            _select(tl.arange(0, BLOCK_T), part_ptr, _group_tile(bias_ptr, EPG, N_GROUP, BLOCK_G, BLOCK_J), ids_ptr,
                    wts_ptr, N, E, EPG, scale, tl.num_programs(1), SPLIT, N_GROUP, TOPK_GROUP, TOP_K, BLOCK_T, BLOCK_G,
                    BLOCK_J, KEYED, ".cg")
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


@_jit
def _route_select(part_ptr, bias_ptr, ids_ptr, wts_ptr, N, E, EPG, scale, n_split, SPLIT: tl.constexpr,
                  N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_J: tl.constexpr, KEYED: tl.constexpr = False,
                  PDL: tl.constexpr = False):
    """The selection of BLOCK_T tokens per program (`_select`), after any router GEMM. The bias is a
    weight (never written): with PDL it is read while the GEMM finishes."""
    bias = _group_tile(bias_ptr, EPG, N_GROUP, BLOCK_G, BLOCK_J)
    pdl_enter(PDL)
    _select(tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T), part_ptr, bias, ids_ptr, wts_ptr, N, E, EPG,
            scale, n_split, SPLIT, N_GROUP, TOPK_GROUP, TOP_K, BLOCK_T, BLOCK_G, BLOCK_J, KEYED, "")


@_jit
def _group_tile(bias_ptr, EPG, N_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_J: tl.constexpr):
    """The bias as a [1, group, member] tile (0 outside the experts)."""
    g3 = tl.arange(0, BLOCK_G)[None, :, None]
    j3 = tl.arange(0, BLOCK_J)[None, None, :]
    return tl.load(bias_ptr + g3 * EPG + j3, mask=(g3 < N_GROUP) & (j3 < EPG), other=0.0)


# Keys for KEYED selection: an FP32 value and its slot in one int64, ordered as the value and, on equal
# values, lowest slot first, so one max reduction finds both the best value and its tie winner (two
# dependent reductions otherwise: max, then the lowest slot holding it). Layout: the FP32 bits mapped
# to [0, 2^32) in the value's order, times 2^16, plus 2^16 - 1 - slot (slots < 2^16: experts <= 4096,
# see `_route_triton_supports`). Literals, not module constants: this module imports without triton.
@_jit
def _key(value, slot):
    """The order-preserving key of `value` at `slot` (+0 for -0, so the two tie as values do)."""
    b = (value + 0.0).to(tl.int32, bitcast=True).to(tl.int64)
    ordered = tl.where(b >= 0, b + 2147483648, -1 - b)
    return ordered * 65536 + (65535 - slot)


@_jit
def _key_value(key):
    """The FP32 value of a key (`_key` inverted)."""
    ordered = key >> 16
    return tl.where(ordered >= 2147483648, ordered - 2147483648, -1 - ordered).to(tl.int32).to(tl.float32,
                                                                                                  bitcast=True)


@_jit
def _select(tok, part_ptr, bias, ids_ptr, wts_ptr, N, E, EPG, scale, n_split, SPLIT: tl.constexpr,
            N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
            BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_J: tl.constexpr, KEYED: tl.constexpr,
            CACHE: tl.constexpr):
    """noaux_tc selection for tokens `tok`, fused: sum of the split-K partials -> sigmoid -> + bias
    -> group score (top-2 sum) -> top TOPK_GROUP groups -> top TOP_K experts in them -> unbiased
    scores there, renormalised, * scale. Experts sit in a [token, group, member] register tile; `bias`
    is the [1, group, member] tile (`_group_tile`). Selection is iterative arg-max, cheaper than a sort
    at 256 experts: TOP_K rounds of two reductions, or with KEYED one reduction of `_key`s a round and
    the groups ranked in one reduction (at one token these reductions, each a chain of warp shuffles,
    are the kernel's critical path). Both pick the same experts, ties included. Ids are written in
    ascending expert order (the contract leaves the order free).
    n_split partials are summed, SPLIT (constexpr) at most: a bound fixed by the config and regime, not
    by the token count, so a new count of split-K partials compiles nothing (runs/serve-sweep-beam-
    501b-tp8/NOTES.md, session 16: each new count had cost a serving step a compile of ~1 s).
    CACHE: the partials' load cache modifier (".cg", from L2, when other programs of the same kernel
    wrote them)."""
    g = tl.arange(0, BLOCK_G)
    t3, g3, j3 = tok[:, None, None], g[None, :, None], tl.arange(0, BLOCK_J)[None, None, :]
    e3 = g3 * EPG + j3
    valid = (t3 < N) & (g3 < N_GROUP) & (j3 < EPG)
    logit = tl.zeros((BLOCK_T, BLOCK_G, BLOCK_J), tl.float32)
    for s in tl.static_range(SPLIT):  # unrolled: the loads overlap; fixed order: bitwise reproducible
        logit += tl.load(part_ptr + (s * N + t3) * E + e3, mask=valid & (t3 * 0 + s < n_split), other=0.0,
                         cache_modifier=CACHE)
    score = 1.0 / (1.0 + tl.exp(-logit))
    neg_inf = float("-inf")
    # NaN scores (a broken GEMM upstream) rank lowest: selection still writes top_k in-range ids, so
    # the gate sees wrong weights instead of the experts' gather reading out of bounds.
    biased = tl.where(valid & (score == score), score + bias, neg_inf)
    # Group score: top-2 sum. Remove only the first maximum so a tied pair counts twice, as topk(2).
    g2 = g[None, :]
    if KEYED:
        top1_key = tl.max(_key(biased, j3), axis=2)
        top1 = _key_value(top1_key)
        first = 65535 - (top1_key & 65535)
    else:
        top1 = tl.max(biased, axis=2)
        first = tl.min(tl.where(biased == top1[:, :, None], j3, BLOCK_J), axis=2)
    top2 = tl.max(tl.where(j3 == first[:, :, None], neg_inf, biased), axis=2)
    group_score = top1 + top2
    if KEYED:  # a group is kept when fewer than TOPK_GROUP groups come before it (higher, or equal and lower)
        other = group_score[:, None, :]
        g_other = g[None, None, :]
        ahead = (g_other < N_GROUP) & ((other > group_score[:, :, None])
                                       | ((other == group_score[:, :, None]) & (g_other < g[None, :, None])))
        keep = ((tl.sum(ahead.to(tl.int32), axis=2) < TOPK_GROUP) & (g2 < N_GROUP)).to(tl.int32)
    else:
        # Arg-max rounds pick among the still-free entries only, so each round takes a new one even
        # when every score left is -inf.
        free_g = (g2 < N_GROUP) & (tok[:, None] >= 0)
        keep = tl.zeros((BLOCK_T, BLOCK_G), tl.int32)
        for _ in tl.static_range(TOPK_GROUP):  # best group, lowest index on a tie
            best = tl.max(tl.where(free_g, group_score, neg_inf), axis=1)
            pick = tl.min(tl.where(free_g & (group_score == best[:, None]), g2, BLOCK_G), axis=1)
            hit = g2 == pick[:, None]
            keep = tl.where(hit, 1, keep)
            free_g = free_g & (g2 != pick[:, None])
    # Experts of the kept groups, flattened to [token, slot]: slot f is member f % BLOCK_J of group
    # f // BLOCK_J, so slot order is expert order (the tie order: lowest expert index first).
    cand = tl.reshape(biased, (BLOCK_T, BLOCK_G * BLOCK_J))
    free = tl.reshape((keep[:, :, None] != 0) & (g3 < N_GROUP) & (j3 < EPG), (BLOCK_T, BLOCK_G * BLOCK_J))
    score = tl.reshape(score, (BLOCK_T, BLOCK_G * BLOCK_J))
    f = tl.arange(0, BLOCK_G * BLOCK_J)[None, :]
    chosen = tl.zeros((BLOCK_T, BLOCK_G * BLOCK_J), tl.int32)
    if KEYED:
        keys = _key(cand, f)  # distinct (the slot is in the key): a round's best matches one slot
        for _ in tl.static_range(TOP_K):
            best = tl.max(tl.where(free, keys, -1), axis=1)[:, None]
            chosen = tl.where(free & (keys == best), 1, chosen)
            free = free & (keys != best)
    else:
        for _ in tl.static_range(TOP_K):
            best = tl.max(tl.where(free, cand, neg_inf), axis=1)
            pick = tl.min(tl.where(free & (cand == best[:, None]), f, BLOCK_G * BLOCK_J), axis=1)
            hit = f == pick[:, None]
            chosen = tl.where(hit, 1, chosen)
            free = free & (f != pick[:, None])
    picked = tl.where(chosen != 0, score, 0.0)
    wts = picked / tl.sum(picked, axis=1)[:, None] * scale
    # Scatter the TOP_K chosen slots of each token to outputs 0..TOP_K-1 (rank = prefix count).
    out = tok[:, None] * TOP_K + tl.cumsum(chosen, axis=1) - 1
    mask = (chosen != 0) & (tok[:, None] < N)
    tl.store(ids_ptr + out, ((f // BLOCK_J) * EPG + f % BLOCK_J).to(tl.int64), mask=mask)
    tl.store(wts_ptr + out, wts, mask=mask)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _split_k(k: int, block_k: int, split: int) -> tuple[int, int]:
    """(splits, K per split): K per split a multiple of block_k, and no split left empty."""
    k_tiles = triton.cdiv(k, block_k)
    per = triton.cdiv(k_tiles, max(1, min(split, k_tiles)))
    return triton.cdiv(k_tiles, per), per * block_k


ROUTE_CONFIGS = [
    # gemv_*: N <= 16; a program reads block_e experts x (K / split) of W (gemv_block_k per step at
    # N = 1, shrunk as N grows so the register tile stays the same size). fp32_*: N <= 96; tc_*:
    # N > 96 (split = most K slices, used only while the output tiles alone cannot fill the GPU).
    # select_*: tokens per program, and warps at that many tokens (fewer tokens, fewer warps: at one
    # token a single warp does the 2 * top_k + 2 * topk_group + 5 reductions with shuffles only).
    # fused_select: at N <= 16 the GEMV's last program to finish selects (no second launch).
    # select_keys: the selection's KEYED form (top_k + 5 reductions, see `_select`); absent: False.
    dict(gemv_block_e=4, gemv_block_k=1024, gemv_split=5, gemv_warps=4,  # 320 CTAs x 16 KB at 256 x 5120
         fp32_block_m=32, fp32_block_e=64, fp32_block_k=32, fp32_split=16, fp32_warps=4,
         tc_block_m=64, tc_block_e=64, tc_block_k=64, tc_split=8, tc_warps=4, tc_stages=3,
         select_tokens=4, select_warps=4, fused_select=False),
    dict(gemv_block_e=1, gemv_block_k=1024, gemv_split=1, gemv_warps=4,  # published: one CTA per expert
         fp32_block_m=16, fp32_block_e=64, fp32_block_k=64, fp32_split=16, fp32_warps=4,
         tc_block_m=64, tc_block_e=128, tc_block_k=64, tc_split=8, tc_warps=8, tc_stages=3,
         select_tokens=8, select_warps=8, fused_select=False),
    # (A 20-way split config, gemv_block_e=16 / gemv_block_k=256 / select_tokens=2, gave NaN weights at
    # 8 tokens on the H200 under triton 3.6 while passing interpreted: the op gate rejected it there;
    # removed until that is understood.)
    dict(gemv_block_e=8, gemv_block_k=512, gemv_split=10, gemv_warps=4,
         fp32_block_m=64, fp32_block_e=64, fp32_block_k=16, fp32_split=8, fp32_warps=8,
         tc_block_m=128, tc_block_e=128, tc_block_k=64, tc_split=16, tc_warps=8, tc_stages=3,
         select_tokens=16, select_warps=16, fused_select=False),
]
ROUTE_CONFIGS += [
    # the first, with the selection run by the GEMV's last program at N <= 16: one launch a decode step
    dict(ROUTE_CONFIGS[0], fused_select=True),
    # the same with half the GEMV programs (160), so half the arrivals on the one counter: the first
    # lost on the H200 (0.447 vs 0.374 ms/step), and its 320 programs all count on a single address
    dict(ROUTE_CONFIGS[0], gemv_block_e=8, gemv_block_k=512, fused_select=True),
    # the decode lock's config (the first) with the keyed selection, in its own launch and fused
    dict(ROUTE_CONFIGS[0], select_keys=True),
    dict(ROUTE_CONFIGS[0], fused_select=True, select_keys=True),
]


def _route_prepare(w):
    """Load-time layout: FP32 weight and bias contiguous, plus the exact BF16x3 split of the weight
    ([3, E, K], W == w1 + w2 + w3 in FP32) for the tensor-core regime. Costs 6 bytes per weight.
    Exact while w3 stays a normal number, |W| >= ~2^-110 (router weights are ~1e-2); below that
    BF16's subnormals drop low bits of w3."""
    weight = w["weight"].float().contiguous()
    w1 = weight.bfloat16()
    r = weight - w1.float()  # exact (Sterbenz): w1 is W rounded to 8 bits
    w2 = r.bfloat16()
    w3 = (r - w2.float()).bfloat16()  # at most 8 significant bits are left: exact in BF16
    return {"weight": weight, "bias": w["bias"].float().contiguous(), "bf16x3": torch.stack([w1, w2, w3])}


def _select_args(part, w, ids, weights, n_group, topk_group, top_k, scale, block_t, max_split=None, keyed=False):
    """The selection's arguments, for `_route_select` or the fused `_route_gemv` (keywords: constexprs):
    sizes (E, EPG, scale, partials in `part`), `max_split` (default: those partials) the bound the
    kernel compiles for, and `keyed` the selection's form (a config's select_keys)."""
    e = w["weight"].shape[0]
    epg = e // n_group
    return (w["bias"], ids, weights), (e, epg, float(scale), part.shape[0]), dict(
        SPLIT=max_split or part.shape[0], N_GROUP=n_group, TOPK_GROUP=topk_group, TOP_K=top_k, BLOCK_T=block_t,
        BLOCK_G=_pow2(n_group), BLOCK_J=_pow2(epg), KEYED=keyed)


def _route_gemv_launch(x, w, cfg, select):
    """The GEMV regime: partial logits [SPLIT, N, E]; with `select` (the selection's outputs and
    settings), the last program also selects (fused_select configs)."""
    n, k = x.shape
    e = w["weight"].shape[0]
    block_n = _pow2(n)
    # Keep the register tile BLOCK_N x BLOCK_E x BLOCK_K near the N = 1 size as N grows.
    block_k = max(16, cfg["gemv_block_k"] // block_n)
    split, per = _split_k(k, block_k, cfg["gemv_split"])
    part = torch.empty((split, n, e), dtype=torch.float32, device=x.device)
    if select is None:  # placeholders for the pointers and sizes the unfused kernel never reads
        outs, sizes, consts = (part, part, part), (0, 0, 0.0, 1), dict(SPLIT=1, N_GROUP=1, TOPK_GROUP=1, TOP_K=1,
                                                                     BLOCK_T=1, BLOCK_G=1, BLOCK_J=1, KEYED=False)
        count = part
    else:
        outs, sizes, consts = _select_args(part, w, *select)
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


def _route_triton_at(cfg):
    def route_triton(x, w, *, n_group, topk_group, top_k, scale):
        x = x.contiguous()
        n = x.shape[0]
        ids = torch.empty((n, top_k), dtype=torch.int64, device=x.device)
        weights = torch.empty((n, top_k), dtype=torch.float32, device=x.device)
        if n == 0:
            return ids, weights
        keyed = cfg.get("select_keys", False)
        # Never 2 tokens per program: BLOCK_T = 2 selected wrong experts on the H200 (triton 3.6),
        # twice, while passing interpreted; 1 (decode) and >= 4 pass the gates there.
        if cfg["fused_select"] and n <= ROUTE_GEMV_MAX:  # one program selects every token
            block_t = 1 if n == 1 else max(4, _pow2(n))
            _route_gemv_launch(x, w, cfg, (ids, weights, n_group, topk_group, top_k, scale, block_t, None, keyed))
            return ids, weights
        part, max_split = _route_logits(x, w, cfg)
        block_t = 1 if n == 1 else max(min(4, cfg["select_tokens"]), min(cfg["select_tokens"], _pow2(n)))
        outs, sizes, consts = _select_args(part, w, ids, weights, n_group, topk_group, top_k, scale, block_t,
                                           max_split, keyed)
        _route_select[(triton.cdiv(n, block_t),)](
            part, *outs, n, *sizes, **consts, num_warps=max(1, cfg["select_warps"] * block_t // cfg["select_tokens"]),
            **pdl_launch(cfg.get("pdl")))
        return ids, weights

    return route_triton


def _route_triton_supports(wl):
    c = wl.config
    if wl.dtype not in ("bf16", "fp16", "fp32"):
        return f"route:triton takes bf16/fp16/fp32 activations, not {wl.dtype}"
    if c.n_routed_experts % c.n_group or c.n_routed_experts // c.n_group < 2:
        return "route:triton needs equal expert groups of at least 2 experts"
    if c.num_experts_per_tok > 64 or c.n_routed_experts > 4096:
        return "route:triton's selection kernel unrolls top_k rounds and holds all experts in registers: " \
               "top_k <= 64 and experts <= 4096"
    return True


register("route", "triton", "triton", prepare=_route_prepare, supports=_route_triton_supports,
         configs=ROUTE_CONFIGS, pdl=True, configure=_route_triton_at)(_route_triton_at(ROUTE_CONFIGS[0]))


# ---- flashinfer: FP32 router GEMM (cuBLAS, no TF32) + FlashInfer's fused noaux_tc selection --------
# `flashinfer.fused_moe.fused_topk_deepseek` documents exactly this point's selection: sigmoid(logits)
# + bias, groups scored by their top-2, top groups, top_k experts, unbiased sigmoid weights
# renormalised times the scale, in FP32 whatever the input dtype. Its limits are in `supports`.

def _route_flashinfer_supports(wl):
    c = wl.config
    per_group = c.n_routed_experts // c.n_group
    if c.n_routed_experts % c.n_group or c.n_group > 32 or per_group > 32 or per_group * c.topk_group > 128:
        return ("fused_topk_deepseek needs equal groups, at most 32 of them, at most 32 experts per group "
                "and at most 128 experts in the kept groups")
    if c.num_experts_per_tok > 8:
        return f"fused_topk_deepseek picks at most 8 experts per token, not {c.num_experts_per_tok}"
    return True


@register("route", "flashinfer", "flashinfer", supports=_route_flashinfer_supports)
def route_flashinfer(x, w, *, n_group, topk_group, top_k, scale):
    from flashinfer.fused_moe import fused_topk_deepseek

    logits = x.float() @ w["weight"].float().t()  # FP32 as the reference (torch keeps TF32 off by default)
    n = logits.shape[0]
    weights = torch.empty(n, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(n, top_k, dtype=torch.int32, device=x.device)
    fused_topk_deepseek(logits, w["bias"].float().contiguous(), n_group, topk_group, top_k, scale, weights, ids,
                        launch_with_pdl=False)
    return ids.long(), weights
