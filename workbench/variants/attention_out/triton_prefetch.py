"""`attention_out:triton_prefetch`: attention_out:triton with attention:triton_prefetch's decode kernel
(each split's first key block loaded before the PDL wait, `_triton_attention_prefetch.py`), then the
same merge-gate kernel and o_proj GEMV: bitwise attention_out:triton at the same configs. Prefill (and
decode past attention_out:triton's GEMV rows) is attention_out:triton's.

A config: `attention` (one of attention:triton_prefetch's configs) and `gemv` (o_proj's tile), as
attention_out:triton's; "pdl" applies to every launch.
"""

from workbench.registry import register
from workbench.variants.kernels.triton_common import gemv_config
from workbench.variants.attention.triton_prefetch import CONFIGS as PREFETCH_CONFIGS
from workbench.variants.attention_out.triton import _at as _attention_out_triton
from workbench.variants.attention_out.triton import _supports
from workbench.variants.attn_out import _GATED_GEMV_MAX_TOKENS

# The decode lock's attention config (BLOCK_N 32, 4 warps: the prefetch's best at window 512 in
# runs/attention-read-floor-tp8/) with the lock's o_proj tile, then the 32K winner's BLOCK_N 128 with
# only K prefetched and with K and V.
CONFIGS = [
    dict(attention=PREFETCH_CONFIGS[4], gemv=gemv_config(4, 256)),
    dict(attention=PREFETCH_CONFIGS[6], gemv=gemv_config(4, 256)),
    dict(attention=PREFETCH_CONFIGS[5], gemv=gemv_config(4, 256)),
]


def _at(config=None):
    config = config or CONFIGS[0]
    pdl = bool(config.get("pdl"))
    attention_cfg, gemv_cfg = {**config["attention"], "pdl": pdl}, {**config["gemv"], "pdl": pdl}
    otherwise = _attention_out_triton(config)

    def attention_out_triton_prefetch(q, cache, meta, g, w, *, window, scale):
        # kernels: imported on use (they need triton, and TRITON_INTERPRET set first on the CPU)
        from workbench.variants.kernels.attention_prefetch import decode_gated
        from workbench.variants.kernels.gemv import linear

        if meta.decode and 0 < q.shape[0] <= _GATED_GEMV_MAX_TOKENS:  # static shape dispatch: graph-safe
            gated = decode_gated(q, cache, meta, g, w["gate_bias"], window=window, scale=scale, cfg=attention_cfg)
            return linear(gated, w["o_proj"].contiguous(), gemv_cfg)
        return otherwise(q, cache, meta, g, w, window=window, scale=scale)
    return attention_out_triton_prefetch


register("attention_out", "triton_prefetch", "triton", supports=_supports, configs=CONFIGS, configure=_at,
         pdl=True)(_at())
