"""Speculative decoding's acceptance of a block of drafts, one Triton program per sequence.

Draft j of a sequence is kept with probability min(1, p_j(d_j) / q_j(d_j)) (p: the target's distribution
at the draft's row, q: the drafter's, d_j the draft) while every draft before it was kept, and no more
than the sequence's `limit` (padding rows are never kept). The token after the kept drafts is drawn from
max(p - q, 0) renormalised at the first rejection, or from p where every keepable draft was kept (or the
residual is empty). The draw is an exponential race, argmax dist / noise with `noise` Exp(1), so the
residual needs no normalising. Greedy sequences take (`kept_greedy`, `bonus_greedy`) instead, computed
apart from their argmaxes. In torch each gather, comparison and reduction here is a kernel of its own; here
one launch does them all.
"""

import torch

from workbench.variants.kernels.triton_common import jit as _jit
from workbench.variants.kernels.triton_common import pow2, tl, triton


@_jit
def _accept_kernel(p_ptr, q_ptr, drafts_ptr, u_ptr, limit_ptr, noise_ptr, greedy_ptr, kept_g_ptr, bonus_g_ptr,
                   kept_ptr, bonus_ptr, K, V, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    limit = tl.load(limit_ptr + i)
    kept = limit * 0
    alive = limit >= 0
    for j in range(0, K):
        d = tl.load(drafts_ptr + i * K + j)
        pd = tl.load(p_ptr + (i * (K + 1) + j) * V + d).to(tl.float64)
        qd = tl.load(q_ptr + (i * K + j) * V + d).to(tl.float64)
        u = tl.load(u_ptr + i * K + j).to(tl.float64)
        alive = alive & (qd > 0) & (u * qd <= pd) & (j < limit)
        kept += alive.to(kept.dtype)
    p_row = p_ptr + (i * (K + 1) + kept) * V
    q_row = q_ptr + (i * K + tl.minimum(kept, K - 1)) * V  # read only after a rejection (kept < limit)
    offs = tl.arange(0, BLOCK)
    total = (limit * 0).to(tl.float64)
    race_r = total - 1
    race_p = total - 1
    at_r = V
    at_p = V
    for start in range(0, V, BLOCK):
        o = start + offs
        live = o < V
        p = tl.load(p_row + o, mask=live, other=0.0).to(tl.float64)
        q = tl.load(q_row + o, mask=live & ((o * 0 + kept) < limit), other=0.0).to(tl.float64)
        e = tl.maximum(tl.load(noise_ptr + i * V + o, mask=live, other=1.0).to(tl.float64), 1e-30)
        r = tl.maximum(p - q, 0.0)
        total += tl.sum(r, axis=0)
        x = tl.where(live, r / e, -1.0)
        cmax = tl.max(x, axis=0)
        at_r = tl.where(cmax > race_r, tl.min(tl.where(x == cmax, o, V), axis=0), at_r)
        race_r = tl.maximum(race_r, cmax)
        x = tl.where(live, p / e, -1.0)
        cmax = tl.max(x, axis=0)
        at_p = tl.where(cmax > race_p, tl.min(tl.where(x == cmax, o, V), axis=0), at_p)
        race_p = tl.maximum(race_p, cmax)
    bonus = tl.where(total > 0, at_r, at_p).to(tl.int64)
    greedy = tl.load(greedy_ptr + i) != 0
    tl.store(kept_ptr + i, tl.where(greedy, tl.load(kept_g_ptr + i), kept.to(tl.int64)))
    tl.store(bonus_ptr + i, tl.where(greedy, tl.load(bonus_g_ptr + i), bonus))


def accept_block(p, q, drafts, u, limit, noise, greedy, kept_greedy, bonus_greedy, *, block: int = 8192):
    """(kept [b], bonus [b]) int64 of each sequence's block: p [b, K + 1, V] the target's distributions at
    the block's rows, q [b, K, V] the drafter's of the drafts, drafts [b, K], u [b, K] uniform draws,
    limit [b] (the drafts that may be kept), noise [b, V] Exp(1) draws for the token after them; greedy
    [b] bool rows take kept_greedy / bonus_greedy [b]. No host sync."""
    if triton is None:
        raise RuntimeError("accept_block needs triton")
    b, k1, v = p.shape
    kept = torch.empty(b, dtype=torch.int64, device=p.device)
    bonus = torch.empty(b, dtype=torch.int64, device=p.device)
    if b:
        q = q if k1 > 1 else p  # no drafts: q is never read
        _accept_kernel[(b,)](p.contiguous(), q.contiguous(), drafts.contiguous(), u.contiguous(),
                             limit.to(torch.int64).contiguous(), noise.contiguous(), greedy.to(torch.int8).contiguous(),
                             kept_greedy.to(torch.int64).contiguous(), bonus_greedy.to(torch.int64).contiguous(),
                             kept, bonus, k1 - 1, v, BLOCK=min(block, pow2(v)), num_warps=16 if v >= 4096 else 4)
    return kept, bonus
