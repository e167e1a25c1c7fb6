"""FlashInfer's paged attention behind the `attention` contract (`workbench/variants/attention/__init__.py`),
run by `attention:flashinfer`. Imported on the variant's first call, never at import time: the variant
module must import without flashinfer.

Our cache layout is FlashInfer's "NHD" paged layout ([pages, 2, page_size, kv_heads, head_dim]), so
the cache is passed as is. What differs is the page table: ours is a dense [B, max_pages] table with
-1 for pages not held (sliding layers release pages that left the window); FlashInfer takes a CSR
list (indptr, indices, last_page_len). Each sequence's list starts at the first page its queries can
see, so a released page is never read. Rebasing a sequence's keys that way keeps every query's
distance to every key, and FlashInfer aligns a request's queries to the end of its keys, so causal
masking and `window_left = window - 1` give exactly the reference's visible set.

Planning (FlashInfer's host-side scheduling) happens outside CUDA graphs, as vLLM and SGLang do:
- decode: one CUDA-graph-mode wrapper per (metadata object, window), planned on the first call that
  sees that metadata (the warm-up call before a capture); the captured kernels read the wrapper's
  fixed buffers. A runner that refills a captured step's metadata calls `replan(meta)` (through
  `BeamForCausalLM.replan`) before replaying, which re-plans from the metadata's device page table and its host
  lengths. A wrapper lives as long as its metadata object.
- prefill (ragged chunks; the server runs them eagerly, the bench may capture them): one wrapper per
  window, re-planned when the step's host layout changes; page ids are gathered on the device on
  every call (see `_prefill_wrapper`).
"""

import weakref

import flashinfer
import torch

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partials)

_workspace: dict[torch.device, torch.Tensor] = {}
_decode: dict[int, dict] = {}     # id(meta) -> {(window, tensor_cores): (wrapper, plan spec)}; dies with meta
_prefill: dict[tuple, dict] = {}  # (device, window) -> wrapper, the layout it is planned for, index buffer


def _float_workspace(device) -> torch.Tensor:
    # One buffer shared by every wrapper: their kernels run one after another on one stream.
    if device not in _workspace:
        _workspace[device] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _workspace[device]


def _page_lists(meta, window, first_query_pos):
    """CSR page lists from each sequence's first visible page to its last held page: host indptr, the
    device positions in `meta.page_table.reshape(-1)` of the listed entries, host last_page_len.
    first_query_pos[b]: position of sequence b's first new token."""
    ps = meta.page_size
    lens = torch.tensor(meta.seq_lens_host, dtype=torch.int64)
    first = torch.tensor(first_query_pos, dtype=torch.int64)
    if window is not None:
        first_page = (first - window + 1).clamp(min=0) // ps
    else:
        first_page = torch.zeros_like(lens)
    last_page = (lens - 1) // ps
    count = last_page - first_page + 1
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = count.cumsum(0)
    rows = torch.repeat_interleave(torch.arange(len(lens)), count)
    cols = first_page[rows] + torch.arange(int(indptr[-1])) - indptr[:-1].long()[rows]
    flat = (rows * meta.page_table.shape[1] + cols).to(meta.page_table.device, non_blocking=True)
    last_len = (lens - last_page * ps).to(torch.int32)
    return indptr, flat, last_len


def _gather(meta, flat, out=None):
    """The listed page ids, read from the device page table (a device op: it can be captured)."""
    return torch.index_select(meta.page_table.reshape(-1), 0, flat, out=out)


def _plan_decode(wrapper, meta, window, spec):
    heads, q_dtype, kv_heads, head_dim, page_size, kv_dtype, scale = spec
    indptr, flat, last_len = _page_lists(meta, window, [n - 1 for n in meta.seq_lens_host])
    wrapper.plan(indptr, _gather(meta, flat), last_len, heads, kv_heads, head_dim, page_size,
                 window_left=-1 if window is None else window - 1, q_data_type=q_dtype,
                 kv_data_type=kv_dtype, sm_scale=scale)


def _decode_wrapper(q, cache, meta, window, scale, tensor_cores):
    per_meta = _decode.get(id(meta))
    if per_meta is None:
        per_meta = _decode[id(meta)] = {}
        weakref.finalize(meta, _decode.pop, id(meta), None)
    key = (window, tensor_cores)
    entry = per_meta.get(key)
    if entry is None:
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("attention:flashinfer must be called once outside a CUDA graph capture "
                               "with the same metadata (its plan runs on the host)")
        b, dev = q.shape[0], q.device
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            _float_workspace(dev), "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=torch.zeros(b + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buffer=torch.zeros(b * meta.page_table.shape[1], dtype=torch.int32, device=dev),
            paged_kv_last_page_len_buffer=torch.zeros(b, dtype=torch.int32, device=dev),
            backend="fa2")
        spec = (q.shape[1], q.dtype, cache.shape[3], cache.shape[4], cache.shape[2], cache.dtype, scale)
        _plan_decode(wrapper, meta, window, spec)
        entry = per_meta[key] = (wrapper, spec)
    return entry[0]


def replan(meta) -> None:
    """Re-plan every decode wrapper of `meta` after its contents (device table, host lengths) changed."""
    for (window, _), (wrapper, spec) in _decode.get(id(meta), {}).items():
        _plan_decode(wrapper, meta, window, spec)


def _prefill_wrapper(q, cache, meta, window, scale):
    """The window's prefill wrapper, planned for this step's host layout. The plan depends on the
    layout only (query and key counts, first visible pages); the page ids are gathered from the
    device table into the planned index buffer on every call, so steps (or a bench's rotated copies)
    with the same layout share one plan, and a captured call replays with whatever pages the table
    holds then. Should FlashInfer copy the indices at plan time instead of keeping the buffer, each
    new metadata object is planned again (not capturable then)."""
    key = (q.device, window)
    entry = _prefill.get(key)
    if entry is None:
        entry = _prefill[key] = dict(wrapper=flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            _float_workspace(q.device), "NHD"), layout=None)
    layout = (tuple(meta.query_start_host), tuple(meta.seq_lens_host), meta.page_table.shape[1], q.shape[1],
              q.dtype, tuple(cache.shape[2:]), cache.dtype, scale)
    if entry["layout"] != layout or (not entry["live"] and entry["meta"]() is not meta):
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("attention:flashinfer prefill must be called once outside a CUDA graph "
                               "capture with this step's layout (its plan runs on the host)")
        starts = meta.query_start_host
        counts = [starts[b + 1] - starts[b] for b in range(len(starts) - 1)]
        first = [n - c for n, c in zip(meta.seq_lens_host, counts)]
        indptr, flat, last_len = _page_lists(meta, window, first)
        indices = _gather(meta, flat)
        wrapper = entry["wrapper"]
        wrapper.plan(torch.tensor(starts, dtype=torch.int32), indptr, indices, last_len, q.shape[1],
                     cache.shape[3], cache.shape[4], cache.shape[2], causal=True,
                     window_left=-1 if window is None else window - 1, sm_scale=scale,
                     q_data_type=q.dtype, kv_data_type=cache.dtype)
        live = getattr(wrapper, "_paged_kv_indices_buf", None) is indices  # FlashInfer 0.7 keeps it
        entry.update(layout=layout, flat=flat, indices=indices, live=live, meta=weakref.ref(meta))
    elif entry["live"]:
        _gather(meta, entry["flat"], out=entry["indices"])
    return entry["wrapper"]


def paged_attention(q, cache, meta, *, window, scale, tensor_cores=False):
    if meta.decode:
        return _decode_wrapper(q, cache, meta, window, scale, tensor_cores).run(q, cache)
    # FlashInfer's prefill zero-fills an output it allocates itself, a pass over the output a prefill
    # step's profile shows; it writes every query row
    out = torch.empty((*q.shape[:-1], cache.shape[-1]), dtype=q.dtype, device=q.device)
    return _prefill_wrapper(q, cache, meta, window, scale).run(q, cache, out=out)
