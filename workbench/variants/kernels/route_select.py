"""The noaux_tc selection of `route`'s Triton variants and the router weight's load-time layout, shared by
`route:triton` (after its own FP32 router GEMMs, or fused into its GEMV's last program) and
`route:triton_cublas` (after cuBLAS GEMMs on the same weight split).

- `prepare_router`: the FP32 weight and bias, and the exact BF16x3 split of the weight.
- `route_select`: one program per BLOCK_T tokens sums the split-K partial logits [SPLIT, N, E] in a
  fixed order, then sigmoid, bias, group top-2 sums, top groups, top-k experts and renormalised
  weights * scale, all in FP32 (`select_experts`, a device function the fused GEMV calls too).
  Ids come out in ascending expert order (the contract's order is free). Tie order (exact ties
  only): lowest group index, then lowest expert index, first.
- `select_args`: the selection's launch arguments for either kernel.

Imports without triton (`triton_common.jit` leaves plain functions); never imports a variant.
"""

import torch

from workbench.variants.kernels.triton_common import jit as _jit
from workbench.variants.kernels.triton_common import pdl_enter, pow2, tl


def prepare_router(w):
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


def select_args(part, w, ids, weights, n_group, topk_group, top_k, scale, block_t, max_split=None, keyed=False):
    """The selection's arguments, for `route_select` or the fused `_route_gemv` (keywords: constexprs):
    sizes (E, EPG, scale, partials in `part`), `max_split` (default: those partials) the bound the
    kernel compiles for, and `keyed` the selection's form (a config's select_keys)."""
    e = w["weight"].shape[0]
    epg = e // n_group
    return (w["bias"], ids, weights), (e, epg, float(scale), part.shape[0]), dict(
        SPLIT=max_split or part.shape[0], N_GROUP=n_group, TOPK_GROUP=topk_group, TOP_K=top_k, BLOCK_T=block_t,
        BLOCK_G=pow2(n_group), BLOCK_J=pow2(epg), KEYED=keyed)


@_jit
def route_select(part_ptr, bias_ptr, ids_ptr, wts_ptr, N, E, EPG, scale, n_split, SPLIT: tl.constexpr,
                 N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_J: tl.constexpr, KEYED: tl.constexpr = False,
                 PDL: tl.constexpr = False):
    """The selection of BLOCK_T tokens per program (`select_experts`), after any router GEMM. The bias
    is a weight (never written): with PDL it is read while the GEMM finishes."""
    bias = group_tile(bias_ptr, EPG, N_GROUP, BLOCK_G, BLOCK_J)
    pdl_enter(PDL)
    select_experts(tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T), part_ptr, bias, ids_ptr, wts_ptr, N, E, EPG,
                   scale, n_split, SPLIT, N_GROUP, TOPK_GROUP, TOP_K, BLOCK_T, BLOCK_G, BLOCK_J, KEYED, "")


@_jit
def group_tile(bias_ptr, EPG, N_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_J: tl.constexpr):
    """The bias as a [1, group, member] tile (0 outside the experts)."""
    g3 = tl.arange(0, BLOCK_G)[None, :, None]
    j3 = tl.arange(0, BLOCK_J)[None, None, :]
    return tl.load(bias_ptr + g3 * EPG + j3, mask=(g3 < N_GROUP) & (j3 < EPG), other=0.0)


# Keys for KEYED selection: an FP32 value and its slot in one int64, ordered as the value and, on equal
# values, lowest slot first, so one max reduction finds both the best value and its tie winner (two
# dependent reductions otherwise: max, then the lowest slot holding it). Layout: the FP32 bits mapped
# to [0, 2^32) in the value's order, times 2^16, plus 2^16 - 1 - slot (slots < 2^16: experts <= 4096,
# which route:triton's `supports` requires). Literals, not module constants: this module imports without
# triton.
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
def select_experts(tok, part_ptr, bias, ids_ptr, wts_ptr, N, E, EPG, scale, n_split, SPLIT: tl.constexpr,
                   N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_J: tl.constexpr, KEYED: tl.constexpr,
                   CACHE: tl.constexpr):
    """noaux_tc selection for tokens `tok`, fused: sum of the split-K partials -> sigmoid -> + bias
    -> group score (top-2 sum) -> top TOPK_GROUP groups -> top TOP_K experts in them -> unbiased
    scores there, renormalised, * scale. Experts sit in a [token, group, member] register tile; `bias`
    is the [1, group, member] tile (`group_tile`). Selection is iterative arg-max, cheaper than a sort
    at 256 experts: TOP_K rounds of two reductions, or with KEYED one reduction of `_key`s a round and
    the groups ranked in one reduction (at one token these reductions, each a chain of warp shuffles,
    are the kernel's critical path). Both pick the same experts, ties included. Ids are written in
    ascending expert order (the contract leaves the order free).
    n_split partials are summed, SPLIT (constexpr) at most: a bound fixed by the config and regime, not
    by the token count, so a new count of split-K partials compiles nothing (docs/decisions.md #29).
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
