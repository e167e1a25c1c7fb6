"""How many KV pages each cache group gets.

The sliding-window pool only has to hold every running sequence's last window plus one step's
chunk, so it is sized from `max_num_seqs` and the token budget (never from the context length);
everything else goes to the full-attention pool, which is what bounds the context. On CUDA the
byte budget comes from free device memory after a profiling step at the full token budget
(`gpu_memory_utilization` of the device in total); on the CPU it is a fixed default. Must never
allocate the pools itself: it only returns counts.
"""

from __future__ import annotations

import math

import torch

from beam_model.config import FULL, SLIDING
from beam_model.kv_cache import PagedKVCache

CPU_KV_BYTES = 512 << 20       # default KV budget on the CPU
CUDA_SLACK_BYTES = 256 << 20    # CUDA graphs, sampling buffers, allocator fragmentation


def page_bytes(config, group: str, dtype: torch.dtype, page_size: int) -> int:
    layers = sum(t == group for t in config.layer_types)
    return layers * 2 * page_size * config.num_key_value_heads * config.head_dim * dtype.itemsize


def sliding_pages_needed(config, *, max_num_seqs: int, max_num_batched_tokens: int, page_size: int,
                         window: int | None = None) -> int:
    """Enough sliding pages for every sequence's window (`window`, default the model's: a drafter reads
    one position further back) and a full step of new tokens, + page 0.

    L consecutive positions touch at most ceil((L-1)/ps)+1 pages; each sequence spans W-1 old
    positions plus its chunk, and the chunks add up to at most the token budget."""
    window = window or config.sliding_window
    per_seq = math.ceil(max(window - 2, 0) / page_size) + 2
    return max_num_seqs * per_seq + math.ceil(max_num_batched_tokens / page_size) + 1


def min_sliding_pages(config, *, max_num_batched_tokens: int, page_size: int, window: int | None = None) -> int:
    """The fewest sliding pages with which one sequence can still feed a full chunk (+ page 0)."""
    return math.ceil(((window or config.sliding_window) - 2 + max_num_batched_tokens) / page_size) + 2


@torch.inference_mode()
def cuda_kv_budget(model, utilization: float, num_tokens: int) -> int:
    """Bytes left for KV pages: `utilization` of the device minus everything in use (weights,
    other processes) minus the activation peak of a step of `num_tokens` prompt tokens."""
    dev = model.device
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    cache = PagedKVCache.for_sequences(model.config, [num_tokens], dtype=model.dtype, device=dev)
    cache.add(0)
    step = cache.prepare_step([0], [num_tokens])
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
    model.step(ids, cache, step)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    del cache, step, ids
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    return int(utilization * total - (total - free) - peak - CUDA_SLACK_BYTES)


def plan_pages(config, dtype: torch.dtype, budget_bytes: int, *, max_num_seqs: int,
               max_num_batched_tokens: int, page_size: int, window: int | None = None,
               sliding_extra_bytes: int = 0) -> dict[str, int]:
    """Split a byte budget: the sliding pool what it needs (at most half), the full pool the rest.
    `sliding_extra_bytes`: what else a sliding page holds (a drafter's keys and values on its ids)."""
    full_b, slide_b = (page_bytes(config, g, dtype, page_size) for g in (FULL, SLIDING))
    slide_b += sliding_extra_bytes if slide_b else 0
    sliding = sliding_pages_needed(config, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                   page_size=page_size, window=window)
    if slide_b:
        floor = min_sliding_pages(config, max_num_batched_tokens=max_num_batched_tokens, page_size=page_size,
                                  window=window)
        sliding = max(floor, min(sliding, budget_bytes // 2 // slide_b))
    full = (budget_bytes - sliding * slide_b) // full_b if full_b else 2
    if full < 2:
        raise ValueError(f"KV budget of {budget_bytes / 2**20:.0f} MiB leaves no room for full-attention pages "
                         f"({full_b / 2**20:.2f} MiB each); lower --max-num-seqs / --max-num-batched-tokens "
                         "or raise --gpu-memory-utilization")
    return {FULL: int(full), SLIDING: int(max(sliding, 2))}
