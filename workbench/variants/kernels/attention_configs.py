"""Tuning configs and workload limits of the Triton attention kernels (`kernels/attention.py` and its
prefetch and wide-merge forms), shared by the `attention` and `attention_out` variants that run them.
Plain data: imports without triton (the variants register before any kernel is defined).

A config tunes both paths (the search times it at its target's shape, decode or prefill): decode
BLOCK_N keys per step, at least MIN_BLOCKS blocks per split, splits for WAVES waves over the SMs (at
most MAX_SPLITS), merged by the last split program when there are at most FUSED_MERGE_MAX_SPLITS (else
by a second kernel), V loaded beside K with EARLY_V; prefill PREFILL_BLOCK_M queries x PREFILL_BLOCK_N
keys per step. The prefetch kernel adds PREFETCH_V (V loaded before the PDL wait beside K, or after the
scores), the wide merge MERGE_BLOCK_D (head_dim columns a merge program).
"""

# attention:triton's configs; the first is `kernels/attention.DEFAULT` (a test checks).
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
    # the fastest of a BLOCK_N x warps x stages sweep at batch 1 (docs/variants.md): a 512-key window
    # in up to 17 splits of 32 keys, and 32K keys of a full layer in 128-key blocks
    dict(BLOCK_N=32, MIN_BLOCKS=1, WAVES=2, MAX_SPLITS=256, num_warps=4, num_stages=2,
         PREFILL_BLOCK_M=64, PREFILL_BLOCK_N=64, PREFILL_WARPS=4, PREFILL_STAGES=2, FUSED_MERGE_MAX_SPLITS=0),
    dict(BLOCK_N=128, MIN_BLOCKS=1, WAVES=2, MAX_SPLITS=256, num_warps=8, num_stages=1,
         PREFILL_BLOCK_M=64, PREFILL_BLOCK_N=64, PREFILL_WARPS=4, PREFILL_STAGES=2, FUSED_MERGE_MAX_SPLITS=0),
]
# V loaded after the scores, and, for the first and the two above, beside K (decode splits of one block)
TRITON_CONFIGS = [dict(c, EARLY_V=False) for c in TRITON_CONFIGS] + \
    [dict(c, EARLY_V=True) for c in (TRITON_CONFIGS[0], *TRITON_CONFIGS[-2:])]

# attention:triton_prefetch's: attention:triton's with a separate merge and V beside K (the prefetch
# decode kernel has no other form), then the two 32K-context ones (BLOCK_N 128 and 64) with only K
# prefetched, since holding K and V of a block across the wait spills there (docs/decisions.md #26).
PREFETCH_CONFIGS = [c for c in TRITON_CONFIGS if not c["FUSED_MERGE_MAX_SPLITS"] and not c["EARLY_V"]]
PREFETCH_CONFIGS += [dict(c, PREFETCH_V=False) for c in (PREFETCH_CONFIGS[-1], PREFETCH_CONFIGS[0])]

# attention:triton_widemerge's: the prefetch's window-512 and 32K-context winners, then one that gives
# each split of a 32K context a single 64-key block with K and V loaded before the PDL wait (512 splits
# at batch 1; at 8 warps it compiles for sm_90 without spilling), each merged 8 columns a program.
WIDEMERGE_CONFIGS = [dict(PREFETCH_CONFIGS[4], MERGE_BLOCK_D=8), dict(PREFETCH_CONFIGS[6], MERGE_BLOCK_D=8),
                     dict(PREFETCH_CONFIGS[6], BLOCK_N=64, WAVES=4, MAX_SPLITS=512, PREFETCH_V=True,
                          MERGE_BLOCK_D=8)]


def supports(wl):
    """Whether the Triton attention kernels take workload `wl`: True, or the reason they cannot."""
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
