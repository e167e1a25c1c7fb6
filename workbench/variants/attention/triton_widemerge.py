"""`attention:triton_widemerge`: attention:triton_prefetch's decode kernel, then a merge that loads
each head's split partials in one round trip over programs of MERGE_BLOCK_D columns
(`_triton_attention_widemerge.py` says why); prefill is attention:triton's.

Configs: attention:triton_prefetch's window-512 and 32K-context winners
(runs/attention-read-floor-tp8/), then one that gives each split of a 32K context a single 64-key
block with K and V loaded before the PDL wait (512 splits at batch 1; at 8 warps it compiles for sm_90
without spilling, `scripts/sm90_resources.py --attention`), each merged 8 columns a program.
"""

from workbench.registry import register
from workbench.variants.attention import _triton_supports
from workbench.variants.attention.triton_prefetch import CONFIGS as PREFETCH_CONFIGS

CONFIGS = [dict(PREFETCH_CONFIGS[4], MERGE_BLOCK_D=8), dict(PREFETCH_CONFIGS[6], MERGE_BLOCK_D=8),
           dict(PREFETCH_CONFIGS[6], BLOCK_N=64, WAVES=4, MAX_SPLITS=512, PREFETCH_V=True, MERGE_BLOCK_D=8)]


def _at(config=None):
    config = config or CONFIGS[0]

    def attention_triton_widemerge(q, cache, meta, *, window, scale):
        # kernels: imported on use (they need triton, and TRITON_INTERPRET set first on the CPU)
        from workbench.variants.kernels.attention_widemerge import paged_attention

        return paged_attention(q, cache, meta, window=window, scale=scale, config=config)
    return attention_triton_widemerge


register("attention", "triton_widemerge", "triton", supports=_triton_supports, configs=CONFIGS, pdl=True,
         configure=_at)(_at())
