"""`attention:window`: the reference's math over only the pages a sliding-window query can see, as a user
writes paged attention for torch.compile.

The reference gathers every page of a sequence's table and masks the keys outside the window, so a
compiled step reads (and converts to FP32) the whole context on every sliding layer: at 4K tokens of
context, eight times the keys a 512-key decode window needs. Here each query reads the pages from the one
holding its oldest visible key: a decode row the `1 + ceil((window - 1) / page_size)` logical pages its
window can span, a prompt chunk the pages from its first query's window to its end. The keys kept, their
masks and the FP32 math are the reference's; full-attention layers read every page, as it does.
"""

import torch

from workbench.registry import register


def _attend(q, k, v, key_pos, q_pos, valid_len, window, scale):
    """q [B, Hq, D]; k/v [B, J, Hkv, D] at key_pos [B, J], or shared [J, Hkv, D] at key_pos [J] (absolute
    positions); valid_len [B] bounds the keys each query may read -> [B, Hq, D] FP32."""
    b, hq, d = q.shape
    hkv = k.shape[-2]
    at = key_pos if key_pos.dim() == 2 else key_pos[None, :]
    visible = (at <= q_pos[:, None]) & (at < valid_len[:, None])
    if window is not None:
        visible &= at > q_pos[:, None] - window
    keys = "bjhd" if k.dim() == 4 else "jhd"
    scores = torch.einsum(f"bhgd,{keys}->bhgj", q.float().view(b, hkv, hq // hkv, d), k.float()) * scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    # V rows no query may read are zeroed: a weight of 0 times a stale NaN there would still be NaN
    readable = visible if k.dim() == 4 else visible.any(0)
    v = torch.where(readable[..., None, None], v.float(), 0.0)
    return torch.einsum(f"bhgj,{keys}->bhgd", scores.softmax(-1), v).reshape(b, hq, d)


def _pages(cache, page_ids):
    """K and V of the given logical pages, [..., pages * page_size, kv_heads, hd]; -1 reads page 0."""
    kv = cache[page_ids.clamp(min=0).long()]
    shape = (*page_ids.shape[:-1], -1, *cache.shape[3:])
    return kv.select(-4, 0).reshape(shape), kv.select(-4, 1).reshape(shape)


@register("attention", "window", "torch")
def attention_window(q, cache, meta, *, window, scale):
    page_size, width = cache.shape[2], meta.page_table.shape[1]
    if meta.decode:  # one query per sequence: vectorised over the batch, no host syncs
        if window is None:
            first = torch.zeros_like(meta.positions)
            logical = torch.arange(width, device=q.device).expand(len(first), width)
        else:
            first = (meta.positions - window + 1).clamp(min=0) // page_size  # page of the oldest visible key
            span = 1 + -(-(window - 1) // page_size)
            # a logical page past the table holds keys past the sequence's length: read, then masked
            logical = (first[:, None] + torch.arange(span, device=q.device)).clamp(max=width - 1)
        k, v = _pages(cache, meta.page_table.gather(1, logical))
        key_pos = first[:, None] * page_size + torch.arange(k.shape[1], device=q.device)
        return _attend(q, k, v, key_pos, meta.positions, meta.seq_lens, window, scale).to(q.dtype)
    out = torch.empty_like(q)
    starts = meta.query_start_host
    for b, length in enumerate(meta.seq_lens_host):
        n = starts[b + 1] - starts[b]
        oldest = 0 if window is None else max(0, length - n - window + 1)  # the chunk's first query's window
        first = oldest // page_size
        k, v = _pages(cache, meta.page_table[b, first: -(-length // page_size)])
        key_pos = first * page_size + torch.arange(k.shape[0], device=q.device)
        qs = slice(starts[b], starts[b + 1])
        out[qs] = _attend(q[qs], k, v, key_pos, meta.positions[qs], meta.seq_lens[b].expand(n), window,
                          scale).to(q.dtype)
    return out
