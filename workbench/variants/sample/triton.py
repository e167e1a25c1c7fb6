"""`sample:triton`: fused sampling without a sort.

One program per row, streaming the row in BLOCK chunks (a 64 KB row at TP8's 16K vocab stays in
L1/L2 across passes). No sort: the top-k cut is found by bisection on the value, the top-p cut by
rejection on the race itself. The race's Exp(1) noise is drawn by torch from `generator`, as the
reference draws it ([N, V], vocab order), so a generator state reproduces the ids. Semantics vs the
reference (which sorts):
 - greedy rows (T <= 0): argmax of the raw logits, lowest index among equal maxima (= torch.argmax);
 - top-k keeps every token whose scaled logit is >= the k-th largest (tokens tied exactly at the
   cut are all kept; the reference keeps exactly k of them, in sort order);
 - top-p keeps a token iff the top-k-renormalised mass strictly above it is <= top_p (the
   reference's exclusive-cumsum test; exact ties at the cut are kept together);
 - the draw is exactly proportional to exp(logit / T) over the kept set (exponential race), but the
   reference pairs noise with sorted positions and this kernel with vocab positions: the same
   distribution, not the same ids.

Imports without triton (`triton_common.jit` leaves plain functions): the variant is registered either
way and the registry reports the backend as unavailable.
"""

import torch

from workbench.registry import register
from workbench.variants.kernels.triton_common import jit as _jit
from workbench.variants.kernels.triton_common import pdl_enter, pdl_launch, pow2, tl


@_jit
def _row(base, words, o, V, other, MASKED: tl.constexpr):
    """Logits `o` of a row (`other` past V); with MASKED, -inf where the row's mask bit is clear."""
    x = tl.load(base + o, mask=o < V, other=other)
    if MASKED:
        w = tl.load(words + o // 32, mask=o < V, other=0)
        x = tl.where(((w >> (o % 32)) & 1) != 0, x, float("-inf"))
    return x


@_jit
def _sample_kernel(logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, noise_ptr, allowed_ptr, out_ptr, V, W,
                   BLOCK: tl.constexpr, MASKED: tl.constexpr, PDL: tl.constexpr = False):
    """Greedy argmax, or temperature + top-k + top-p + one draw, for one row; every step a pass.

    1. max and first argmax of the raw logits: the greedy answer, and m = max / T for the softmax.
    2. top-k (0 < k < V): bisection over the int32 order key of s = logits / T for the k-th largest
       value: one counting pass per step, <= 32 steps, stopping early once exactly k are >= mid.
    3. Z = sum e over the kept set, e = exp(s - m), and the race winner j = argmax kept e / noise.
    4. top-p (p < 1), by rejection: j stands iff the kept mass strictly above s_j is <= p * Z;
       else the race is rerun with the same noise over the kept tokens above s_j. The race's
       memorylessness makes the accepted token exactly proportional to exp(s) over the nucleus. A
       round is one pass and accepts with probability >= p, so rows average about 1 / p rounds.
    With MASKED, every pass reads a token the row's mask leaves out as -inf (never kept, never drawn)."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * V
    words = allowed_ptr + row.to(tl.int64) * W
    noise = noise_ptr + row.to(tl.int64) * V
    offs = tl.arange(0, BLOCK)
    neg_inf = float("-inf")
    best = neg_inf
    result = 0
    for start in range(0, V, BLOCK):
        o = start + offs
        x = _row(base, words, o, V, neg_inf, MASKED)
        cmax = tl.max(x, axis=0)
        first = tl.min(tl.where((x == cmax) & (o < V), o, V), axis=0)
        result = tl.where(cmax > best, first, result)  # strict: an earlier chunk wins a tie
        best = tl.maximum(best, cmax)
    temperature = tl.load(temp_ptr + row)
    if temperature > 0:
        t = tl.maximum(temperature, 1e-6)  # the reference's clamp
        k = tl.load(top_k_ptr + row).to(tl.int32)
        p = tl.maximum(tl.load(top_p_ptr + row), 0.0)
        m = best / t  # = max(s): division by t > 0 is monotone
        # Order key: the FP32 bits as int32 with negatives' magnitude bits flipped (keeps order).
        lo = (k * 0) - 2147483647 - 1  # kept set: key >= lo (all of the row unless top-k applies)
        if (k > 0) & (k < V):
            mb = m.to(tl.int32, bitcast=True)
            hi = (mb ^ ((mb >> 31) & 0x7FFFFFFF)) + 1  # count(key >= lo) >= k > count(key >= hi)
            count = V
            while (lo + 1 < hi) & (count != k):
                mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
                c = 0
                for start in range(0, V, BLOCK):
                    o = start + offs
                    b = (_row(base, words, o, V, 0.0, MASKED) / t).to(tl.int32, bitcast=True)
                    c += tl.sum(((b ^ ((b >> 31) & 0x7FFFFFFF) >= mid) & (o < V)).to(tl.int32), axis=0)
                lo = tl.where(c >= k, mid, lo)
                count = tl.where(c >= k, c, count)
                hi = tl.where(c >= k, hi, mid)
        z = 0.0
        race = neg_inf
        j = V
        for start in range(0, V, BLOCK):
            o = start + offs
            s = _row(base, words, o, V, 0.0, MASKED) / t
            b = s.to(tl.int32, bitcast=True)
            kept = (o < V) & ((b ^ ((b >> 31) & 0x7FFFFFFF)) >= lo)
            e = tl.where(kept, tl.exp(s - m), 0.0)
            z += tl.sum(e, axis=0)
            r = tl.where(kept, e / tl.load(noise + o, mask=o < V, other=1.0), neg_inf)
            cmax = tl.max(r, axis=0)
            j = tl.where(cmax > race, tl.min(tl.where(r == cmax, o, V), axis=0), j)
            race = tl.maximum(race, cmax)
        done = (p >= 1.0).to(tl.int32)
        while done == 0:
            sj = tl.load(base + tl.minimum(j, V - 1)) / t
            above = 0.0
            race = neg_inf
            nxt = V
            for start in range(0, V, BLOCK):
                o = start + offs
                s = _row(base, words, o, V, 0.0, MASKED) / t
                b = s.to(tl.int32, bitcast=True)
                up = (o < V) & ((b ^ ((b >> 31) & 0x7FFFFFFF)) >= lo) & (s > sj)
                e = tl.where(up, tl.exp(s - m), 0.0)
                above += tl.sum(e, axis=0)
                r = tl.where(up, e / tl.load(noise + o, mask=o < V, other=1.0), neg_inf)
                cmax = tl.max(r, axis=0)
                nxt = tl.where(cmax > race, tl.min(tl.where(r == cmax, o, V), axis=0), nxt)
                race = tl.maximum(race, cmax)
            accept = (above <= p * z) | (nxt >= V)
            done = accept.to(tl.int32)
            j = tl.where(accept, j, nxt)
        result = j
    tl.store(out_ptr + row, result.to(tl.int64))


# block: the chunk a pass loads at once (a batch-1 row is one CTA's work: fewer, larger chunks mean
# fewer round trips to memory per pass).
CONFIGS = [dict(block=4096, num_warps=16), dict(block=2048, num_warps=8), dict(block=8192, num_warps=16),
                  dict(block=1024, num_warps=4)]


def _sample_triton_at(cfg):
    def sample_triton(logits, temperature, top_k, top_p, *, generator=None, allowed=None):
        n, v = logits.shape
        out = torch.empty(n, dtype=torch.int64, device=logits.device)
        if n == 0:
            return out
        race = torch.empty((n, v), dtype=torch.float32, device=logits.device).exponential_(generator=generator)
        words = race if allowed is None else allowed.contiguous()  # any pointer when unmasked: never read
        _sample_kernel[(n,)](logits.float().contiguous(), temperature.float().contiguous(), top_k.contiguous(),
                             top_p.float().contiguous(), race, words, out, v, words.shape[-1],
                             BLOCK=min(cfg["block"], pow2(v)), MASKED=allowed is not None,
                             num_warps=cfg["num_warps"], **pdl_launch(cfg.get("pdl")))
        return out

    return sample_triton


def _supports(wl):
    if wl.config.vocab_size >= 2 ** 31:
        return "sample:triton indexes a row with int32"
    return True


register("sample", "triton", "triton", supports=_supports, configs=CONFIGS, pdl=True,
         configure=_sample_triton_at)(_sample_triton_at(CONFIGS[0]))
