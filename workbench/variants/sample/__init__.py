"""`sample`: next-token choice from FP32 logits.

Contract: `sample(logits, temperature, top_k, top_p, *, generator=None) -> ids`; logits [N, V]
FP32; per row: temperature [N] FP32 (0 = greedy argmax), top_k [N] int (0 = off), top_p [N] FP32
(1 = off). Top-k is applied before top-p (the most likely token always survives), then one draw
from the renormalised distribution by the exponential-race (Gumbel-max) trick, reproducible for a
given `generator`. No host syncs. Returns ids [N] int64.
"""

import math

import torch

from workbench.points import Call, PointSpec, declare
from workbench.registry import register
from workbench.variants.inputs import Rand


@register("sample", "torch", "torch")
def sample(logits, temperature, top_k, top_p, *, generator=None):
    greedy = logits.argmax(-1)
    scaled = logits.float() / temperature.clamp(min=1e-6)[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = (top_k[:, None] > 0) & (ranks >= top_k[:, None])
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    drop |= (probs.cumsum(-1) - probs) > top_p[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    race = torch.empty_like(probs).exponential_(generator=generator)
    choice = (probs / race).argmax(-1, keepdim=True)
    sampled = order.gather(1, choice).squeeze(1)
    return torch.where(temperature > 0, sampled, greedy)


# ---- spec: inputs, roofline and tolerance for the harness ------------------------------------------

# Per-row (temperature, top_k, top_p): greedy rows, plain sampling, and each filter alone and mixed.
MIXES = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 20, 1.0), (1.3, 0, 0.9), (1.0, 5, 0.8), (2.0, 50, 0.95)]
DRAWS = 512      # draws per sampled row for the statistical check
MAX_ROWS = 4     # sampled rows checked statistically per case
Z = 5.0          # chi-square critical value at ~3e-7: a right sampler fails once in millions of cases


def _inputs(wl, device, seed):
    r = Rand("sample", wl, device, seed)
    n = wl.tokens
    rows = [MIXES[(i + seed) % len(MIXES)] for i in range(n)]  # seed rotates the mix: b1 sees several
    temperature, top_k, top_p = (torch.tensor(col, dtype=dt, device=r.device)
                                 for col, dt in zip(zip(*rows), (torch.float32, torch.int64, torch.float32)))
    logits = r.normal(n, wl.config.vocab_size, std=5.0, dtype=torch.float32)
    generator = torch.Generator(device=r.device).manual_seed(seed)
    return Call((logits, temperature, top_k, top_p), dict(generator=generator))


def _probs(logits, temperature, top_k, top_p, slack=0.0):
    """FP64 probabilities of the contract's distribution per row (temperature > 0 rows)."""
    z = logits.double() / temperature.double().clamp(min=1e-6)[:, None]
    sorted_z, order = z.sort(dim=-1, descending=True)
    ranks = torch.arange(z.shape[-1], device=z.device)[None, :]
    drop = (top_k[:, None] > 0) & (ranks >= top_k[:, None])
    p = sorted_z.masked_fill(drop, -math.inf).softmax(-1)
    drop |= (p.cumsum(-1) - p) > top_p.double()[:, None] + slack
    p = sorted_z.masked_fill(drop, -math.inf).softmax(-1)
    return torch.zeros_like(p).scatter_(1, order, p)


def _chi2(counts, probs):
    """Pearson chi-square and degrees of freedom; bins with expected count < 5 pooled."""
    chi2, df = 0.0, 0
    for c, p in zip(counts.tolist(), probs.tolist()):
        total = sum(c)
        bins = sorted(zip(p, c), reverse=True)
        kept = [(total * pi, ci) for pi, ci in bins if total * pi >= 5]
        pooled = (sum(total * pi for pi, _ in bins) - sum(e for e, _ in kept), total - sum(ci for _, ci in kept))
        if pooled[0] >= 5 or not kept:
            kept.append(pooled)
        else:  # too small to stand alone: fold into the smallest kept bin
            kept[-1] = (kept[-1][0] + pooled[0], kept[-1][1] + pooled[1])
        chi2 += sum((ci - e) ** 2 / e for e, ci in kept if e > 0)
        df += len(kept) - 1
    return chi2, df


def _compare(call, out, ref, tol, run=None):
    """Greedy rows exact; every draw inside its row's top-k/top-p support; with `run`, the
    empirical distribution of DRAWS draws per sampled row against FP64 (chi-square)."""
    logits, temperature, top_k, top_p = call.args
    ids = out[0]
    if ids.dtype != torch.int64:
        return [("greedy", None, None, False, f"ids are {ids.dtype}, want int64")]
    greedy = temperature == 0
    wrong = int((ids != logits.argmax(-1))[greedy].sum())
    allowed = _probs(logits, temperature, top_k, top_p, slack=1e-6) > 0
    outside = int((~allowed.gather(1, ids.clamp(0, logits.shape[1] - 1)[:, None])[:, 0] & ~greedy).sum())
    results = [("greedy", float(wrong), 0.0, wrong == 0, f"{int(greedy.sum())} greedy rows")]
    if run is None or greedy.all():
        return results + [("support", float(outside), 0.0, outside == 0, "draws outside top-k/top-p")]
    rows = (~greedy).nonzero().flatten()[:MAX_ROWS]
    # One batch holds many copies of each row: few calls, one shape whatever the case.
    batch = max(len(rows), min(2048, 2 ** 24 // logits.shape[1]))
    reps = batch // len(rows)
    counts = torch.zeros(len(rows), logits.shape[1], dtype=torch.int64, device=logits.device)
    for i in range(math.ceil(DRAWS / reps)):
        sub = [a[rows].repeat_interleave(reps, 0) for a in call.args]
        got = run(Call(tuple(sub), dict(generator=torch.Generator(device=logits.device).manual_seed(10_000 + i))))[0]
        counts.scatter_add_(1, got.view(len(rows), reps), torch.ones_like(got.view(len(rows), reps)))
    outside += int((counts * ~allowed[rows]).sum())
    chi2, df = _chi2(counts.cpu(), _probs(*(a[rows] for a in call.args)).cpu())
    crit = df * (1 - 2 / (9 * df) + Z * math.sqrt(2 / (9 * df))) ** 3 if df else 0.0  # Wilson-Hilferty
    return results + [
        ("support", float(outside), 0.0, outside == 0, "draws outside top-k/top-p"),
        ("distribution", chi2, crit, chi2 <= crit, f"chi-square over {len(rows)} rows x {counts[0].sum()} draws, "
                                                   f"{df} dof"),
    ]


# Ids, not values: no tolerance applies; `compare` judges them.
declare(PointSpec(
    "sample", _inputs,
    bytes=lambda wl: wl.tokens * (4 * wl.config.vocab_size + 24),
    flops=lambda wl: 6 * wl.tokens * wl.config.vocab_size,  # scale, two softmaxes, the race
    tolerance={"fp32": 0.0, "fp16": 0.0, "bf16": 0.0},
    compare=_compare,
))


# ---- triton: fused sampling without a sort ----------------------------------------------------------
#
# One program per row, streaming the row in BLOCK chunks (a 64 KB row at TP8's 16K vocab stays in
# L1/L2 across passes). No sort: the top-k cut is found by bisection on the value, the top-p cut by
# rejection on the race itself. The race's Exp(1) noise is drawn by torch from `generator`, as the
# reference draws it ([N, V], vocab order), so a generator state reproduces the ids. Semantics vs the
# reference (which sorts):
#  - greedy rows (T <= 0): argmax of the raw logits, lowest index among equal maxima (= torch.argmax);
#  - top-k keeps every token whose scaled logit is >= the k-th largest (tokens tied exactly at the
#    cut are all kept; the reference keeps exactly k of them, in sort order);
#  - top-p keeps a token iff the top-k-renormalised mass strictly above it is <= top_p (the
#    reference's exclusive-cumsum test; exact ties at the cut are kept together);
#  - the draw is exactly proportional to exp(logit / T) over the kept set (exponential race), but the
#    reference pairs noise with sorted positions and this kernel with vocab positions: the same
#    distribution, not the same ids.

from workbench.variants.kernels.triton_common import jit as _jit, pdl_enter, pdl_launch, tl  # noqa: E402


@_jit
def _sample_kernel(logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, noise_ptr, out_ptr, V, BLOCK: tl.constexpr,
                   PDL: tl.constexpr = False):
    """Greedy argmax, or temperature + top-k + top-p + one draw, for one row; every step a pass.

    1. max and first argmax of the raw logits: the greedy answer, and m = max / T for the softmax.
    2. top-k (0 < k < V): bisection over the int32 order key of s = logits / T for the k-th largest
       value: one counting pass per step, <= 32 steps, stopping early once exactly k are >= mid.
    3. Z = sum e over the kept set, e = exp(s - m), and the race winner j = argmax kept e / noise.
    4. top-p (p < 1), by rejection: j stands iff the kept mass strictly above s_j is <= p * Z;
       else the race is rerun with the same noise over the kept tokens above s_j. The race's
       memorylessness makes the accepted token exactly proportional to exp(s) over the nucleus. A
       round is one pass and accepts with probability >= p, so rows average about 1 / p rounds."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * V
    noise = noise_ptr + row.to(tl.int64) * V
    offs = tl.arange(0, BLOCK)
    neg_inf = float("-inf")
    best = neg_inf
    result = 0
    for start in range(0, V, BLOCK):
        o = start + offs
        x = tl.load(base + o, mask=o < V, other=neg_inf)
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
                    b = (tl.load(base + o, mask=o < V, other=0.0) / t).to(tl.int32, bitcast=True)
                    c += tl.sum(((b ^ ((b >> 31) & 0x7FFFFFFF) >= mid) & (o < V)).to(tl.int32), axis=0)
                lo = tl.where(c >= k, mid, lo)
                count = tl.where(c >= k, c, count)
                hi = tl.where(c >= k, hi, mid)
        z = 0.0
        race = neg_inf
        j = V
        for start in range(0, V, BLOCK):
            o = start + offs
            s = tl.load(base + o, mask=o < V, other=0.0) / t
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
                s = tl.load(base + o, mask=o < V, other=0.0) / t
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


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# block: the chunk a pass loads at once (a batch-1 row is one CTA's work: fewer, larger chunks mean
# fewer round trips to memory per pass).
SAMPLE_CONFIGS = [dict(block=4096, num_warps=16), dict(block=2048, num_warps=8), dict(block=8192, num_warps=16),
                  dict(block=1024, num_warps=4)]


def _sample_triton_at(cfg):
    def sample_triton(logits, temperature, top_k, top_p, *, generator=None):
        n, v = logits.shape
        out = torch.empty(n, dtype=torch.int64, device=logits.device)
        if n == 0:
            return out
        race = torch.empty((n, v), dtype=torch.float32, device=logits.device).exponential_(generator=generator)
        _sample_kernel[(n,)](logits.float().contiguous(), temperature.float().contiguous(), top_k.contiguous(),
                             top_p.float().contiguous(), race, out, v, BLOCK=min(cfg["block"], _pow2(v)),
                             num_warps=cfg["num_warps"], **pdl_launch(cfg.get("pdl")))
        return out

    return sample_triton


def _sample_triton_supports(wl):
    if wl.config.vocab_size >= 2 ** 31:
        return "sample:triton indexes a row with int32"
    return True


register("sample", "triton", "triton", supports=_sample_triton_supports, configs=SAMPLE_CONFIGS, pdl=True,
         configure=_sample_triton_at)(_sample_triton_at(SAMPLE_CONFIGS[0]))
