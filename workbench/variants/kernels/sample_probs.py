"""The `sample` contract's distribution per row, without a sort: what speculative decoding's rejection
sampling reads (the target's and the drafter's probabilities), one Triton program per row.

`contract_probs` (the point's FP64 reference) sorts each row and runs a kernel for each step after the sort;
at a verify step's rows of 8192 tokens the sorts alone cost more than the whole of this kernel (see
`runs/speculative-beam-mini-h100/sampled-half/`). Here one launch does it all, in FP32:
 - the top-k cut (0 < k < V) by bisection over the int32 order key of s = logits / T, as
   `sample:triton` finds it (tokens tied exactly at the cut are all kept; the reference keeps k of them);
 - the top-p cut (p < 1) by bisection over the same key for the least cut c whose kept mass strictly
   above it is <= p times the kept mass: a token stays iff the renormalised mass above it is <= p, the
   reference's exclusive-cumsum test (tokens tied exactly are kept together);
 - the probabilities exp(s - max) / Z over what is kept, written in the output's dtype.
Greedy rows (T <= 0) get the reference's clamp (T = 1e-6): all mass on the row's maximum.

With `noise` (Exp(1) draws [N, V], as the engine's generator gives them) the same launch also draws a token
a row, the exponential race argmax p / noise, and returns its probability: what a drafter's sampled drafts
need. A greedy row's token is its argmax (the lowest index among equal maxima, as torch.argmax) and its
probability the softmax's at temperature 1 (the drafter's confidence in it).
"""

import torch

from workbench.variants.kernels.triton_common import jit as _jit
from workbench.variants.kernels.triton_common import pow2, tl, triton


@_jit
def _scaled(base, o, V, t):
    """s = logits / T at offsets `o` (-inf past V) and their int32 order keys (FP32 bits with the
    negatives' magnitude bits flipped: ascending keys are ascending values)."""
    s = tl.load(base + o, mask=o < V, other=float("-inf")) / t
    b = s.to(tl.int32, bitcast=True)
    return s, b ^ ((b >> 31) & 0x7FFFFFFF)


@_jit
def _count_at_least(base, V, t, cut, BLOCK: tl.constexpr):
    """How many tokens have key >= cut."""
    offs = tl.arange(0, BLOCK)
    c = 0
    for start in range(0, V, BLOCK):
        o = start + offs
        _, key = _scaled(base, o, V, t)
        c += tl.sum(((key.to(tl.int64) >= cut) & (o < V)).to(tl.int32), axis=0)
    return c


@_jit
def _mass(base, V, t, m, lo, above, BLOCK: tl.constexpr):
    """Sum of exp(s - m) over the tokens with key >= lo and key > above."""
    offs = tl.arange(0, BLOCK)
    z = 0.0
    for start in range(0, V, BLOCK):
        o = start + offs
        s, key = _scaled(base, o, V, t)
        k64 = key.to(tl.int64)
        z += tl.sum(tl.where((o < V) & (k64 >= lo) & (k64 > above), tl.exp(s - m), 0.0), axis=0)
    return z


@_jit
def _probs_kernel(logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, out_ptr, noise_ptr, ids_ptr, chosen_ptr, V,
                  BLOCK: tl.constexpr, DRAW: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * V
    out = out_ptr + row.to(tl.int64) * V
    offs = tl.arange(0, BLOCK)
    temperature = tl.load(temp_ptr + row)
    t = tl.maximum(temperature, 1e-6)
    k = tl.load(top_k_ptr + row)
    p = tl.maximum(tl.load(top_p_ptr + row), 0.0)
    best = float("-inf")
    for start in range(0, V, BLOCK):
        s, _ = _scaled(base, start + offs, V, t)
        best = tl.maximum(best, tl.max(s, axis=0))
    if DRAW:
        if temperature <= 0:  # the argmax, and its softmax probability at temperature 1
            first = V
            raw = float("-inf")
            for start in range(0, V, BLOCK):
                o = start + offs
                x = tl.load(base + o, mask=o < V, other=float("-inf"))
                cmax = tl.max(x, axis=0)
                first = tl.where(cmax > raw, tl.min(tl.where((x == cmax) & (o < V), o, V), axis=0), first)
                raw = tl.maximum(raw, cmax)
            total = 0.0
            for start in range(0, V, BLOCK):
                o = start + offs
                total += tl.sum(tl.exp(tl.load(base + o, mask=o < V, other=float("-inf")) - raw), axis=0)
            tl.store(ids_ptr + row, first.to(tl.int64))
            tl.store(chosen_ptr + row, (1.0 / total).to(chosen_ptr.dtype.element_ty))
    mb = best.to(tl.int32, bitcast=True)
    top = (mb ^ ((mb >> 31) & 0x7FFFFFFF)).to(tl.int64)  # the maximum's key
    # top-k: the largest lo with count(key >= lo) >= k; every key when top-k is off
    lo = top * 0 - 2147483647 - 1  # INT32_MIN: a global must be a constexpr
    if (k > 0) & (k < V):
        hi = top + 1  # count(key >= hi) = 0 < k
        count = V
        while (lo + 1 < hi) & (count != k):
            mid = (lo + hi) // 2
            c = _count_at_least(base, V, t, mid, BLOCK)
            lo = tl.where(c >= k, mid, lo)
            count = tl.where(c >= k, c, count)
            hi = tl.where(c >= k, hi, mid)
    # top-p: the least cut in [lo, top] whose kept mass above it is <= p * z (at top it is 0)
    z = _mass(base, V, t, best, lo, lo - 1, BLOCK)
    cut = lo
    if p < 1.0:
        below = lo - 1  # mass above `below` (all of z) > p * z unless p >= 1
        cut = top
        while below + 1 < cut:
            mid = (below + cut) // 2
            ok = _mass(base, V, t, best, lo, mid, BLOCK) <= p * z
            cut = tl.where(ok, mid, cut)
            below = tl.where(ok, below, mid)
        z = _mass(base, V, t, best, cut, cut - 1, BLOCK)
    race = (z * 0 - 1).to(tl.float64)
    drawn = V
    chosen = (z * 0).to(tl.float64)
    for start in range(0, V, BLOCK):
        o = start + offs
        s, key = _scaled(base, o, V, t)
        prob = (tl.where(key.to(tl.int64) >= cut, tl.exp(s - best), 0.0) / z).to(out.dtype.element_ty)
        tl.store(out + o, prob, mask=o < V)
        if DRAW:
            e = tl.load(noise_ptr + row.to(tl.int64) * V + o, mask=o < V, other=1.0).to(tl.float64)
            r = tl.where(o < V, prob.to(tl.float64) / tl.maximum(e, 1e-30), -1.0)
            cmax = tl.max(r, axis=0)
            at = tl.min(tl.where(r == cmax, o, V), axis=0)
            chosen = tl.where(cmax > race, tl.sum(tl.where(o == at, prob.to(tl.float64), 0.0), axis=0), chosen)
            drawn = tl.where(cmax > race, at, drawn)
            race = tl.maximum(race, cmax)
    if DRAW:
        if temperature > 0:
            tl.store(ids_ptr + row, drawn.to(tl.int64))
            tl.store(chosen_ptr + row, chosen.to(chosen_ptr.dtype.element_ty))


def sample_probs(logits, temperature, top_k, top_p, *, noise=None, dtype=torch.float64, block: int = 8192):
    """Probabilities [N, V] (`dtype`) of each row's `sample` distribution: logits [N, V] (any float dtype,
    read as FP32), temperature [N], top_k [N] (0 = off), top_p [N] (1 = off). With `noise` [N, V] (Exp(1)):
    (probabilities, a token drawn a row [N] int64, its probability [N] `dtype`). No host sync."""
    if triton is None:
        raise RuntimeError("sample_probs needs triton")
    n, v = logits.shape
    out = torch.empty((n, v), dtype=dtype, device=logits.device)
    ids = torch.empty(n, dtype=torch.int64, device=logits.device)
    chosen = torch.empty(n, dtype=dtype, device=logits.device)
    if n:
        _probs_kernel[(n,)](logits.float().contiguous(), temperature.float().contiguous(),
                            top_k.to(torch.int64).contiguous(), top_p.float().contiguous(), out,
                            out if noise is None else noise.contiguous(), ids, chosen, v,
                            BLOCK=min(block, pow2(v)), DRAW=noise is not None, num_warps=16 if v >= 4096 else 4)
    return out if noise is None else (out, ids, chosen)
