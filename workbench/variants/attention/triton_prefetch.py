"""`attention:triton_prefetch`: attention:triton with each decode split's first key block loaded
before the PDL wait (`kernels/attention_prefetch.py` says what may be read early, docs/decisions.md
#21); prefill is attention:triton's. Same bits as attention:triton at the same config. Its configs
(`attention_configs.PREFETCH_CONFIGS`) are attention:triton's with a separate merge and V beside K,
then two with only K prefetched.
"""

from workbench.registry import register
from workbench.variants.kernels.attention_configs import PREFETCH_CONFIGS, supports


def _at(config=None):
    def attention_triton_prefetch(q, cache, meta, *, window, scale):
        # kernels: imported on use (they need triton, and TRITON_INTERPRET set first on the CPU)
        from workbench.variants.kernels.attention_prefetch import paged_attention

        return paged_attention(q, cache, meta, window=window, scale=scale, config=config)
    return attention_triton_prefetch


register("attention", "triton_prefetch", "triton", supports=supports, configs=PREFETCH_CONFIGS, pdl=True,
         configure=_at)(_at())
