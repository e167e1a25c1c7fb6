"""`attention`: paged causal attention over the KV cache, sliding-window or full.

Contract: `attention(q, cache, meta, *, window, scale) -> o`.
- q [N, heads, hd] (prepared by `qk_prep`); cache [pages, 2, page_size, kv_heads, hd] (read only);
  meta: the layer group's `AttentionMetadata` (positions, seq_lens, query_start, page_table with
  -1 for pages not held, decode flag, host copies of the ragged layout).
- A query at position p sees keys at positions max(0, p - window + 1) .. p of its own sequence
  (window None: 0 .. p). GQA: query head h reads kv head h // (heads / kv_heads).
- Scores, softmax and the weighted sum in FP32; o [N, heads, hd] rounded once to q's dtype.
"""

import torch

from workbench.points import Call, PointSpec, declare
from workbench.registry import register
from workbench.variants.inputs import DTYPE_BYTES, Rand, paged_kv, visible_keys


def _attend(q, k, v, q_pos, valid_len, window, scale):
    """q [B, Hq, D]; k/v [B, J, Hkv, D] (per query) or [J, Hkv, D] (shared) -> [B, Hq, D] FP32.

    Key j sits at absolute position j; valid_len [B] bounds the keys each query may read."""
    b, hq, d = q.shape
    hkv = k.shape[-2]
    key_pos = torch.arange(k.shape[-3], device=q.device)
    visible = (key_pos[None, :] <= q_pos[:, None]) & (key_pos[None, :] < valid_len[:, None])
    if window is not None:
        visible &= key_pos[None, :] > q_pos[:, None] - window
    keys = "bjhd" if k.dim() == 4 else "jhd"
    qg = q.float().view(b, hkv, hq // hkv, d)
    scores = torch.einsum(f"bhgd,{keys}->bhgj", qg, k.float()) * scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    # Zero the V rows no query may read: a weight of 0 times a stale NaN there would still be NaN.
    readable = visible if k.dim() == 4 else visible.any(0)
    v = torch.where(readable[..., None, None], v.float(), 0.0)
    return torch.einsum(f"bhgj,{keys}->bhgd", scores.softmax(-1), v).reshape(b, hq, d)


def _gather_pages(cache, page_ids):
    """K and V of the given logical pages, [..., pages*page_size, kv_heads, hd]; missing pages read page 0."""
    kv = cache[page_ids.clamp(min=0).long()]  # [..., P, 2, ps, Hkv, D]
    shape = (*page_ids.shape[:-1], -1, *cache.shape[3:])
    return kv.select(-4, 0).reshape(shape), kv.select(-4, 1).reshape(shape)


@register("attention", "torch", "torch")
def attention(q, cache, meta, *, window, scale):
    page_size = cache.shape[2]
    if meta.decode:  # one query per sequence: vectorised over the batch, no host syncs
        k, v = _gather_pages(cache, meta.page_table)
        return _attend(q, k, v, meta.positions, meta.seq_lens, window, scale).to(q.dtype)
    out = torch.empty_like(q)
    starts = meta.query_start_host
    for b, length in enumerate(meta.seq_lens_host):
        pages = meta.page_table[b, : -(-length // page_size)]
        k, v = _gather_pages(cache, pages)
        qs = slice(starts[b], starts[b + 1])
        n = starts[b + 1] - starts[b]
        o = _attend(q[qs], k, v, meta.positions[qs], meta.seq_lens[b].expand(n), window, scale)
        out[qs] = o.to(q.dtype)
    return out


# ---- spec: inputs, roofline and tolerance for the harness ------------------------------------------


def inputs(wl, device, seed):
    c, r = wl.config, Rand("attention", wl, device, seed)
    cache, meta = paged_kv(wl, r)
    window = c.sliding_window if wl.layer == "sliding" else None
    q = r.normal(wl.tokens, c.num_attention_heads, c.head_dim)
    return Call((q, cache, meta), dict(window=window, scale=c.head_dim ** -0.5))


def _bytes(wl):
    c, n = wl.config, wl.tokens
    # The KV the step's queries can see, read once: the window plus the chunk on sliding layers.
    seen = wl.context if wl.layer == "full" else min(wl.context, wl.tokens_per_seq + c.sliding_window - 1)
    return DTYPE_BYTES[wl.dtype] * (2 * n * c.q_width + wl.batch * seen * 2 * c.kv_width) + 8 * n


declare(PointSpec(
    "attention", inputs, bytes=_bytes,
    flops=lambda wl: 4 * wl.batch * sum(visible_keys(wl)) * wl.config.q_width,  # QK^T and PV per visible key
    tolerance={"fp32": 1e-5, "fp16": 8e-4, "bf16": 6e-3},  # ~2.5x the reference's worst vs FP64
))
