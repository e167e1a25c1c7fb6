"""`sample`: next-token choice from FP32 logits.

Contract: `sample(logits, temperature, top_k, top_p, *, generator=None, allowed=None) -> ids`;
logits [N, V] FP32; per row: temperature [N] FP32 (0 = greedy argmax), top_k [N] int (0 = off),
top_p [N] FP32 (1 = off); `allowed` (a grammar's token mask, or None = every token) [N, ceil(V/32)]
int32, bit j of word i set iff token 32 i + j may be drawn: the format grammar engines fill
(xgrammar, llguidance). A token not allowed is out before anything else (greedy rows included, as if
its logit were -inf). Top-k is applied before top-p (the most likely allowed token always survives),
then one draw from the renormalised distribution by the exponential-race (Gumbel-max) trick,
reproducible for a given `generator`. No host syncs. Returns ids [N] int64.
"""

import math

import torch

from workbench.points import Call, PointSpec, declare
from workbench.registry import register
from workbench.variants.inputs import Rand


def allowed_mask(allowed, vocab: int):
    """The contract's bitmask [N, ceil(V/32)] int32 as [N, V] bool."""
    bits = torch.arange(32, device=allowed.device, dtype=torch.int32)
    return ((allowed[:, :, None] >> bits) & 1).bool().flatten(1)[:, :vocab]


def pack_allowed(mask):
    """[N, V] bool -> the contract's bitmask [N, ceil(V/32)] int32 (bit j of word i: token 32 i + j)."""
    n, vocab = mask.shape
    words = -(-vocab // 32)
    padded = torch.nn.functional.pad(mask, (0, 32 * words - vocab)).view(n, words, 32).long()
    packed = (padded << torch.arange(32, device=mask.device)).sum(-1)
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def mask_logits(logits, allowed):
    """`logits` with the tokens `allowed` leaves out at -inf (out of place); `logits` when None."""
    return logits if allowed is None else logits.masked_fill(~allowed_mask(allowed, logits.shape[-1]), -math.inf)


@register("sample", "torch", "torch")
def sample(logits, temperature, top_k, top_p, *, generator=None, allowed=None):
    logits = mask_logits(logits, allowed)
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


def contract_probs(logits, temperature, top_k, top_p, slack=0.0, allowed=None):
    """FP64 probabilities of the contract's distribution per row (temperature > 0 rows)."""
    z = mask_logits(logits.double(), allowed) / temperature.double().clamp(min=1e-6)[:, None]
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


def gate_mask(logits, seed: int):
    """A grammar-like mask for the gate: per row about a quarter of the vocabulary, never the row's
    argmax (a variant that ignores the mask picks it on a greedy row), and one row with a single
    token left (a forced token)."""
    gen = torch.Generator(device=logits.device).manual_seed(20_000 + seed)
    keep = torch.rand(logits.shape, generator=gen, device=logits.device) < 0.25
    keep.scatter_(1, logits.argmax(-1, keepdim=True), False)
    keep[:, 0] |= ~keep.any(-1)  # a row left empty keeps token 0
    only = int(torch.randint(logits.shape[1], (1,), generator=gen, device=logits.device))
    keep[-1] = False
    keep[-1, only if only != int(logits[-1].argmax()) else (only + 1) % logits.shape[1]] = True
    return pack_allowed(keep)


def _judge(call, ids, run, label: str) -> list:
    """Greedy rows exact; every draw inside its row's support (mask, top-k, top-p); with `run`, the
    empirical distribution of DRAWS draws per sampled row against FP64 (chi-square)."""
    logits, temperature, top_k, top_p = call.args
    allowed_bits = call.kwargs.get("allowed")
    if ids.dtype != torch.int64:
        return [(f"{label}greedy", None, None, False, f"ids are {ids.dtype}, want int64")]
    greedy = temperature == 0
    wrong = int((ids != mask_logits(logits, allowed_bits).argmax(-1))[greedy].sum())
    allowed = contract_probs(logits, temperature, top_k, top_p, slack=1e-6, allowed=allowed_bits) > 0
    outside = int((~allowed.gather(1, ids.clamp(0, logits.shape[1] - 1)[:, None])[:, 0] & ~greedy).sum())
    results = [(f"{label}greedy", float(wrong), 0.0, wrong == 0, f"{int(greedy.sum())} greedy rows")]
    if run is None or greedy.all():
        return results + [(f"{label}support", float(outside), 0.0, outside == 0, "draws outside the support")]
    rows = (~greedy).nonzero().flatten()[:MAX_ROWS]
    # One batch holds many copies of each row: few calls, one shape whatever the case.
    batch = max(len(rows), min(2048, 2 ** 24 // logits.shape[1]))
    reps = min(batch // len(rows), DRAWS)  # DRAWS a row: more would only cost time (the interpreter's most)
    counts = torch.zeros(len(rows), logits.shape[1], dtype=torch.int64, device=logits.device)
    extra = {} if allowed_bits is None else {"allowed": allowed_bits[rows].repeat_interleave(reps, 0)}
    for i in range(math.ceil(DRAWS / reps)):
        sub = [a[rows].repeat_interleave(reps, 0) for a in call.args]
        generator = torch.Generator(device=logits.device).manual_seed(10_000 + i)
        got = run(Call(tuple(sub), dict(generator=generator, **extra)))[0]
        counts.scatter_add_(1, got.view(len(rows), reps), torch.ones_like(got.view(len(rows), reps)))
    outside += int((counts * ~allowed[rows]).sum())
    probs = contract_probs(*(a[rows] for a in call.args),
                           allowed=None if allowed_bits is None else allowed_bits[rows])
    chi2, df = _chi2(counts.cpu(), probs.cpu())
    crit = df * (1 - 2 / (9 * df) + Z * math.sqrt(2 / (9 * df))) ** 3 if df else 0.0  # Wilson-Hilferty
    return results + [(f"{label}support", float(outside), 0.0, outside == 0, "draws outside the support"),
                      (f"{label}distribution", chi2, crit, chi2 <= crit,
                       f"chi-square over {len(rows)} rows x {counts[0].sum()} draws, {df} dof")]


def _compare(call, out, ref, tol, run=None):
    """The call as made (no mask: every token allowed), then, with `run`, the same logits under a
    grammar-like mask (`gate_mask`): both judged by `_judge`."""
    results = _judge(call, out[0], run, "")
    if run is None or call.kwargs.get("allowed") is not None:
        return results
    generator = call.kwargs.get("generator")
    seed = int(generator.initial_seed()) if generator is not None else 0
    masked = Call(call.args, dict(call.kwargs, allowed=gate_mask(call.args[0], seed)))
    return results + _judge(masked, run(masked)[0], run, "masked ")


# Ids, not values: no tolerance applies; `compare` judges them.
declare(PointSpec(
    "sample", _inputs,
    bytes=lambda wl: wl.tokens * (4 * wl.config.vocab_size + 24),
    flops=lambda wl: 6 * wl.tokens * wl.config.vocab_size,  # scale, two softmaxes, the race
    tolerance={"fp32": 0.0, "fp16": 0.0, "bf16": 0.0},
    compare=_compare,
))
