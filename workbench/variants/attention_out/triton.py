"""`attention_out:triton`: attention:triton's split-K decode, then one kernel that merges the splits and
applies attn_out's gate (`kernels/attention_gated_merge.py`), then attn_out:triton_gemv's o_proj GEMV:
one launch fewer per layer than the two points apart. Prefill (and decode past 16 rows, where o_proj
is cuBLAS's job) runs attention:triton, then attn_out:triton's gate kernel and F.linear. The sequence
is `kernels/attention_three_launches.py`'s, which the other attention_out variants fall back to.

A config names the attention decode config (`attention`, one of `attention_configs.TRITON_CONFIGS`)
and the o_proj GEMV's (`gemv`); "pdl" applies to every launch.
"""

from workbench.registry import register
from workbench.variants.kernels.attention_configs import TRITON_CONFIGS as ATTENTION_CONFIGS
from workbench.variants.kernels.attention_three_launches import launch_configs, supports, three_launches
from workbench.variants.kernels.triton_common import gemv_config

# The decode lock's attention config (17 splits of 32 keys over a 512-key window) and o_proj tile,
# then attention's default and its 32K-context fastest with a whole o_proj row a step.
CONFIGS = [
    dict(attention=ATTENTION_CONFIGS[5], gemv=gemv_config(4, 256)),
    dict(attention=ATTENTION_CONFIGS[0], gemv=gemv_config(4, 1024)),
    dict(attention=ATTENTION_CONFIGS[6], gemv=gemv_config(4, 256)),
]


def _at(config=None):
    pdl, attention_cfg, gemv_cfg = launch_configs(config or CONFIGS[0])

    def attention_out_triton(q, cache, meta, g, w, *, window, scale):
        return three_launches(q, cache, meta, g, w, window=window, scale=scale, attention_cfg=attention_cfg,
                              gemv_cfg=gemv_cfg, pdl=pdl)
    return attention_out_triton


register("attention_out", "triton", "triton", supports=supports, configs=CONFIGS, configure=_at, pdl=True)(_at())
