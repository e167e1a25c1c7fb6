"""`attention:window`: the reference's math over only the pages a sliding-window decode query can see, as
a user writes paged decode attention for torch.compile.

The reference's decode path gathers every page of the page table and masks the keys outside the window,
so a compiled step reads (and converts to FP32) the whole context on every sliding layer: at 4K tokens of
context, eight times the keys its 512-key window needs. Here a decode row gathers the
`1 + ceil((window - 1) / page_size)` logical pages its window can span, from the first page holding its
oldest visible key, and runs the reference on them with positions counted from that page, so the keys
it keeps and their order are the reference's. Prompts and full-attention layers run the reference.
"""

from dataclasses import replace

import torch

from workbench.registry import register
from workbench.variants.attention import attention as reference


@register("attention", "window", "torch")
def attention_window(q, cache, meta, *, window, scale):
    if window is None or not meta.decode:
        return reference(q, cache, meta, window=window, scale=scale)
    page_size = cache.shape[2]
    span = 1 + -(-(window - 1) // page_size)  # logical pages a window of keys can touch
    first = (meta.positions - window + 1).clamp(min=0) // page_size  # [B] page of the oldest visible key
    logical = first[:, None] + torch.arange(span, device=q.device)
    # A logical page past the table holds keys past the sequence's length: read, then masked as unwritten.
    pages = meta.page_table.gather(1, logical.clamp(max=meta.page_table.shape[1] - 1))
    offset = first * page_size
    shifted = replace(meta, page_table=pages, positions=meta.positions - offset, seq_lens=meta.seq_lens - offset)
    return reference(q, cache, shifted, window=window, scale=scale)
