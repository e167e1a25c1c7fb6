"""`attention_out:triton_prefetch`: attention_out:triton with attention:triton_prefetch's decode kernel
(each split's first key block loaded before the PDL wait, `kernels/attention_prefetch.py`), then the
same merge-gate kernel and o_proj GEMV: bitwise attention_out:triton at the same configs. Prefill (and
decode past the gated GEMV's rows) is attention_out:triton's (`kernels/attention_three_launches.py`).

A config: `attention` (one of `attention_configs.PREFETCH_CONFIGS`) and `gemv` (o_proj's tile), as
attention_out:triton's; "pdl" applies to every launch.
"""

from workbench.registry import register
from workbench.variants.kernels.attention_configs import PREFETCH_CONFIGS
from workbench.variants.kernels.attention_three_launches import launch_configs, supports, three_launches
from workbench.variants.kernels.output_gate import GATED_GEMV_MAX_TOKENS
from workbench.variants.kernels.triton_common import gemv_config

# The decode lock's attention config (BLOCK_N 32, 4 warps: the prefetch's fastest at window 512) with
# the lock's o_proj tile, then the 32K-context fastest's BLOCK_N 128 with only K prefetched and with
# K and V.
CONFIGS = [
    dict(attention=PREFETCH_CONFIGS[4], gemv=gemv_config(4, 256)),
    dict(attention=PREFETCH_CONFIGS[6], gemv=gemv_config(4, 256)),
    dict(attention=PREFETCH_CONFIGS[5], gemv=gemv_config(4, 256)),
]


def _at(config=None):
    pdl, attention_cfg, gemv_cfg = launch_configs(config or CONFIGS[0])

    def attention_out_triton_prefetch(q, cache, meta, g, w, *, window, scale):
        # kernels: imported on use (they need triton, and TRITON_INTERPRET set first on the CPU)
        from workbench.variants.kernels.attention_prefetch import decode_gated
        from workbench.variants.kernels.gemv import linear

        if meta.decode and 0 < q.shape[0] <= GATED_GEMV_MAX_TOKENS:  # static shape dispatch: graph-safe
            gated = decode_gated(q, cache, meta, g, w["gate_bias"], window=window, scale=scale, cfg=attention_cfg)
            return linear(gated, w["o_proj"].contiguous(), gemv_cfg)
        return three_launches(q, cache, meta, g, w, window=window, scale=scale, attention_cfg=attention_cfg,
                              gemv_cfg=gemv_cfg, pdl=pdl)
    return attention_out_triton_prefetch


register("attention_out", "triton_prefetch", "triton", supports=supports, configs=CONFIGS, configure=_at,
         pdl=True)(_at())
