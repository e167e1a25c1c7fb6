"""`attention:triton_prefetch`: attention:triton with each decode split's first key block loaded
before the PDL wait (`_triton_attention_prefetch.py` says what may be read early, and why); prefill
is attention:triton's. Same bits as attention:triton at the same config. Its configs are
attention:triton's with a separate merge and V beside K (the decode kernel has no other form), then
the two 32K-context ones (BLOCK_N 128 and 64) with only K prefetched: holding K and V of a block across
the wait spilled there (runs/attention-read-floor-tp8/, `scripts/sm90_resources.py --attention`).
"""

from workbench.registry import register
from workbench.variants.attention import TRITON_CONFIGS, _triton_supports

CONFIGS = [c for c in TRITON_CONFIGS if not c["FUSED_MERGE_MAX_SPLITS"] and not c["EARLY_V"]]
CONFIGS += [dict(c, PREFETCH_V=False) for c in (CONFIGS[-1], CONFIGS[0])]


def _at(config=None):
    def attention_triton_prefetch(q, cache, meta, *, window, scale):
        # kernels: imported on use (they need triton, and TRITON_INTERPRET set first on the CPU)
        from workbench.variants.kernels.attention_prefetch import paged_attention

        return paged_attention(q, cache, meta, window=window, scale=scale, config=config)
    return attention_triton_prefetch


register("attention", "triton_prefetch", "triton", supports=_triton_supports, configs=CONFIGS, pdl=True,
         configure=_at)(_at())
