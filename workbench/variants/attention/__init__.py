"""`attention`: paged causal attention over the KV cache, sliding-window or full.

Contract: `attention(q, cache, meta, *, window, scale) -> o`.
- q [N, heads, hd] (prepared by `qk_prep`); cache [pages, 2, page_size, kv_heads, hd] (read only);
  meta: the layer group's `AttentionMetadata` (positions, seq_lens, query_start, page_table with
  -1 for pages not held, decode flag, host copies of the ragged layout).
- A query at position p sees keys at positions max(0, p - window + 1) .. p of its own sequence
  (window None: 0 .. p). GQA: query head h reads kv head h // (heads / kv_heads).
- Scores, softmax and the weighted sum in FP32; o [N, heads, hd] rounded once to q's dtype.
"""

import sys

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


def _inputs(wl, device, seed):
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
    "attention", _inputs, bytes=_bytes,
    flops=lambda wl: 4 * wl.batch * sum(visible_keys(wl)) * wl.config.q_width,  # QK^T and PV per visible key
    tolerance={"fp32": 1e-5, "fp16": 8e-4, "bf16": 6e-3},  # ~2.5x the reference's worst vs FP64
))


# ---- triton: portable paged attention, split-K decode + flash prefill (_triton_attention.py) ------
# The kernels are imported on the first call: this module must import without triton, and under the
# CPU interpreter TRITON_INTERPRET must be set before they are defined. One config tunes both paths
# (the search times it at its target's shape, decode or prefill): decode BLOCK_N keys per step, at
# least MIN_BLOCKS blocks per split, splits for WAVES waves over the SMs (at most MAX_SPLITS), merged by
# the last split program when there are at most FUSED_MERGE_MAX_SPLITS (else by a second kernel);
# prefill PREFILL_BLOCK_M queries x PREFILL_BLOCK_N keys per step.

TRITON_CONFIGS = [
    dict(BLOCK_N=64, MIN_BLOCKS=1, WAVES=2, MAX_SPLITS=256, num_warps=4, num_stages=2,
         PREFILL_BLOCK_M=64, PREFILL_BLOCK_N=64, PREFILL_WARPS=4, PREFILL_STAGES=2, FUSED_MERGE_MAX_SPLITS=0),
    dict(BLOCK_N=64, MIN_BLOCKS=4, WAVES=1, MAX_SPLITS=64, num_warps=4, num_stages=3,
         PREFILL_BLOCK_M=128, PREFILL_BLOCK_N=64, PREFILL_WARPS=8, PREFILL_STAGES=2, FUSED_MERGE_MAX_SPLITS=0),
    dict(BLOCK_N=32, MIN_BLOCKS=2, WAVES=4, MAX_SPLITS=256, num_warps=2, num_stages=2,
         PREFILL_BLOCK_M=64, PREFILL_BLOCK_N=32, PREFILL_WARPS=4, PREFILL_STAGES=3, FUSED_MERGE_MAX_SPLITS=0),
    dict(BLOCK_N=128, MIN_BLOCKS=2, WAVES=2, MAX_SPLITS=128, num_warps=8, num_stages=2,
         PREFILL_BLOCK_M=128, PREFILL_BLOCK_N=128, PREFILL_WARPS=8, PREFILL_STAGES=1, FUSED_MERGE_MAX_SPLITS=0),
    # the first, with the splits of a window (at most 9 of 64 keys at window 512) merged by the last
    # split program to finish instead of a second kernel
    dict(BLOCK_N=64, MIN_BLOCKS=1, WAVES=2, MAX_SPLITS=256, num_warps=4, num_stages=2,
         PREFILL_BLOCK_M=64, PREFILL_BLOCK_N=64, PREFILL_WARPS=4, PREFILL_STAGES=2, FUSED_MERGE_MAX_SPLITS=16),
    # the fastest of a BLOCK_N x warps x stages sweep at batch 1 (runs/bench-attention-tp8/,
    # session 10): a 512-key window in up to 17 splits of 32 keys, and 32K keys of a full layer in 128-key blocks
    dict(BLOCK_N=32, MIN_BLOCKS=1, WAVES=2, MAX_SPLITS=256, num_warps=4, num_stages=2,
         PREFILL_BLOCK_M=64, PREFILL_BLOCK_N=64, PREFILL_WARPS=4, PREFILL_STAGES=2, FUSED_MERGE_MAX_SPLITS=0),
    dict(BLOCK_N=128, MIN_BLOCKS=1, WAVES=2, MAX_SPLITS=256, num_warps=8, num_stages=1,
         PREFILL_BLOCK_M=64, PREFILL_BLOCK_N=64, PREFILL_WARPS=4, PREFILL_STAGES=2, FUSED_MERGE_MAX_SPLITS=0),
]
# V loaded after the scores, and, for the first and the two above, beside K (decode splits of one block)
TRITON_CONFIGS = [dict(c, EARLY_V=False) for c in TRITON_CONFIGS] + \
    [dict(c, EARLY_V=True) for c in (TRITON_CONFIGS[0], *TRITON_CONFIGS[-2:])]


def _triton_supports(wl):
    c = wl.config
    if wl.dtype not in ("bf16", "fp16", "fp32"):
        return f"attention:triton takes bf16, fp16 or fp32 q and KV cache, not {wl.dtype}"
    if c.head_dim > 256:
        return f"attention:triton handles head_dim <= 256 (one FP32 accumulator row per query), got {c.head_dim}"
    if c.num_attention_heads // c.num_key_value_heads > 64:
        return "attention:triton holds at most 64 query heads per kv head in a decode program"
    # Any head_dim <= 256 (padded to a power of two >= 16 and masked), any page size (page ids are
    # gathered per key), any window, any GQA ratio up to 64.
    return True


def _triton_at(config=None):
    def attention_triton(q, cache, meta, *, window, scale):
        from workbench.variants.kernels.attention import paged_attention

        return paged_attention(q, cache, meta, window=window, scale=scale, config=config)
    return attention_triton


register("attention", "triton", "triton", supports=_triton_supports, configs=TRITON_CONFIGS, pdl=True,
         configure=_triton_at)(_triton_at())


# ---- flashinfer: FlashInfer's paged decode (FA2, CUDA-core or tensor-core) and prefill wrappers ----
# (_flashinfer_attention.py). Decode plans are made outside CUDA graphs: a runner that refills a
# captured step's metadata calls the bound callable's `replan(meta)` before replaying (see
# `beam_model.model.replan`).

FLASHINFER_HEAD_DIMS = (64, 128, 256)  # the head sizes FlashInfer's kernels are instantiated for


def _flashinfer_supports(wl):
    if wl.dtype not in ("bf16", "fp16"):
        return f"attention:flashinfer takes bf16 or fp16 q and KV cache, not {wl.dtype}"
    if wl.config.head_dim not in FLASHINFER_HEAD_DIMS:
        return f"attention:flashinfer needs head_dim in {FLASHINFER_HEAD_DIMS}, got {wl.config.head_dim}"
    return True


def _flashinfer_replan(meta):
    module = sys.modules.get("workbench.variants.kernels.flashinfer_attention")
    if module is not None:  # never called yet: nothing planned
        module.replan(meta)


def _flashinfer_at(config=None):
    tensor_cores = bool((config or {}).get("tensor_cores", False))

    def attention_flashinfer(q, cache, meta, *, window, scale):
        from workbench.variants.kernels.flashinfer_attention import paged_attention

        return paged_attention(q, cache, meta, window=window, scale=scale, tensor_cores=tensor_cores)
    attention_flashinfer.replan = _flashinfer_replan
    return attention_flashinfer


register("attention", "flashinfer", "flashinfer", supports=_flashinfer_supports,
         configs=[dict(tensor_cores=False), dict(tensor_cores=True)], configure=_flashinfer_at)(_flashinfer_at())
