"""`attention:triton`: portable paged attention in Triton (`kernels/attention.py`): a split-K decode,
its splits merged by a second kernel or (configs with FUSED_MERGE_MAX_SPLITS) by the last split
program to finish, and a flash prefill. One config tunes both paths (`kernels/attention_configs.py`).

The kernels are imported on the first call: this module must import without triton, and under the CPU
interpreter TRITON_INTERPRET must be set before they are defined.
"""

from workbench.registry import register
from workbench.variants.kernels.attention_configs import TRITON_CONFIGS, supports


def _at(config=None):
    def attention_triton(q, cache, meta, *, window, scale):
        from workbench.variants.kernels.attention import paged_attention

        return paged_attention(q, cache, meta, window=window, scale=scale, config=config)
    return attention_triton


register("attention", "triton", "triton", supports=supports, configs=TRITON_CONFIGS, pdl=True,
         configure=_at)(_at())
