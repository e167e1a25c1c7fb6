"""`attention:triton_widemerge`: attention:triton_prefetch's decode kernel, then a merge that loads
each head's split partials in one round trip over programs of MERGE_BLOCK_D columns
(`kernels/attention_widemerge.py` says why); prefill is attention:triton's. Its configs:
`attention_configs.WIDEMERGE_CONFIGS`.
"""

from workbench.registry import register
from workbench.variants.kernels.attention_configs import WIDEMERGE_CONFIGS, supports


def _at(config=None):
    config = config or WIDEMERGE_CONFIGS[0]

    def attention_triton_widemerge(q, cache, meta, *, window, scale):
        # kernels: imported on use (they need triton, and TRITON_INTERPRET set first on the CPU)
        from workbench.variants.kernels.attention_widemerge import paged_attention

        return paged_attention(q, cache, meta, window=window, scale=scale, config=config)
    return attention_triton_widemerge


register("attention", "triton_widemerge", "triton", supports=supports, configs=WIDEMERGE_CONFIGS, pdl=True,
         configure=_at)(_at())
