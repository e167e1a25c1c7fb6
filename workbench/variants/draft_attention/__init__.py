"""`draft_attention`: a DFlash drafter's block attention over its paged context store.

Contract: `draft_attention(q, store, pages, offsets, mask) -> o`.
- q [S * B, heads, hd]: the queries of S blocks of B rows each (block s's rows s * B .. s * B + B - 1),
  prepared by `qk_prep`; store [pages, 2, page_size, kv_heads, hd]: a draft layer's keys and values
  (read only), the block's own already written by `qk_prep`.
- pages, offsets [S, K] int64: where block s finds its K keys (its context, then its own block);
  pages are valid indices of `store` (a key that does not exist points at some page and is masked);
  mask [S, K] additive in q's dtype: 0 where the key exists, -inf where it does not.
- Every row of a block attends to all of its block's K keys (no causal order inside the block), at
  scale hd ** -0.5, GQA: query head h reads kv head h // (heads / kv_heads). Scores, softmax and the
  weighted sum in FP32; o [S * B, heads, hd] rounded once to q's dtype.
- A kernel reads the store only after its programmatic-dependent-launch wait: the same step's `qk_prep`
  writes the block's keys just before.
"""

import math

import torch
import torch.nn.functional as F

from workbench.points import Call, PointSpec, declare
from workbench.registry import register
from workbench.variants.inputs import DTYPE_BYTES, Rand

PAGE_SIZE = 64  # the engine's KV page: the drafter's context sits in the target's sliding-window pages


@register("draft_attention", "torch", "torch")
def draft_attention(q, store, pages, offsets, mask):
    s, n_keys = pages.shape
    n, heads, hd = q.shape
    b, kv_heads = n // s, store.shape[3]
    rep = heads // kv_heads
    dt = torch.promote_types(q.dtype, torch.float32)
    kv = store[pages, :, offsets].to(dt)  # [S, K, 2, kv_heads, hd]
    keys, values = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # [S, kv_heads, K, hd]
    # Every row of a block sees the same keys, so the query heads that share a kv head are one longer
    # query sequence [S, kv_heads, rep * B, hd]: one attention call, no repeated keys or values
    qg = q.to(dt).reshape(s, b, kv_heads, rep, hd).permute(0, 2, 3, 1, 4).reshape(s, kv_heads, rep * b, hd)
    o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask.to(dt)[:, None, None, :])
    return o.view(s, kv_heads, rep, b, hd).permute(0, 3, 1, 2, 4).reshape(n, heads, hd).to(q.dtype)


# ---- spec: inputs, roofline and tolerance for the harness ------------------------------------------


def _sizes(wl):
    """(blocks, rows a block, context keys a block): the drafter's context is its window (the target's)."""
    b = wl.tokens_per_seq
    return wl.batch, b, min(wl.config.sliding_window, max(wl.context - b, 1))


def inputs(wl, device, seed):
    """S blocks, block s after position p_s = C + 13 s: its context p_s - C .. p_s - 1 in scattered 64-token
    pages (as a sequence's page table holds them), its own keys in pages of its own, every other block's
    context starting late (keys before it masked, as at a sequence's start). Every slot random."""
    c, r = wl.config, Rand("draft_attention", wl, device, seed)
    s, b, ctx = _sizes(wl)
    starts = [ctx + 13 * i for i in range(s)]
    per_seq = [math.ceil(p / PAGE_SIZE) + math.ceil(b / PAGE_SIZE) for p in starts]
    perm = torch.randperm(sum(per_seq) + 2, generator=r.gen, device=r.device)
    pages, offsets, valid, used = [], [], [], 0
    for i, p in enumerate(starts):
        table = perm[used: used + per_seq[i]]
        used += per_seq[i]
        at = torch.arange(p - ctx, p, device=r.device)
        own = torch.arange(b, device=r.device)
        first_own = math.ceil(p / PAGE_SIZE)
        pages.append(torch.cat([table[at // PAGE_SIZE], table[first_own + own // PAGE_SIZE]]))
        offsets.append(torch.cat([at % PAGE_SIZE, own % PAGE_SIZE]))
        seen = ctx if i % 2 == 0 else ctx // 2 + 1
        context_valid = torch.arange(ctx, device=r.device) >= ctx - seen
        valid.append(torch.cat([context_valid, torch.ones_like(own, dtype=torch.bool)]))
    store = r.normal(perm.numel(), 2, PAGE_SIZE, c.num_key_value_heads, c.head_dim)
    valid = torch.stack(valid)
    mask = torch.zeros(valid.shape, dtype=r.dtype, device=r.device).masked_fill_(~valid, float("-inf"))
    q = r.normal(s * b, c.num_attention_heads, c.head_dim)
    return Call((q, store, torch.stack(pages).long(), torch.stack(offsets).long(), mask))


def _bytes(wl):
    c = wl.config
    s, b, ctx = _sizes(wl)
    keys = s * (ctx + b)
    return DTYPE_BYTES[wl.dtype] * (2 * s * b * c.q_width + keys * (2 * c.kv_width + 1)) + 16 * keys


def _flops(wl):
    s, b, ctx = _sizes(wl)
    return 4 * s * b * (ctx + b) * wl.config.q_width  # QK^T and PV per key a row sees


declare(PointSpec(
    "draft_attention", inputs, bytes=_bytes, flops=_flops,
    tolerance={"fp32": 1e-5, "fp16": 8e-4, "bf16": 6e-3},  # the attention point's: the same FP32 math
))
