"""`attention_out:triton`: attention:triton's split-K decode, then one kernel that merges the splits and
applies attn_out's gate, then attn_out:triton_gemv's o_proj GEMV (`_triton_attention_out.py`): one
launch fewer per layer than the two points apart. Prefill (and decode past 16 rows, where o_proj is
cuBLAS's job) runs attention:triton, then attn_out:triton's gate kernel and F.linear.

A config names the attention decode config (`attention`, one of attention.TRITON_CONFIGS' keys) and
the o_proj GEMV's (`gemv`); "pdl" applies to every launch.
"""

import torch.nn.functional as F

from workbench.registry import register
from workbench.variants.kernels.triton_common import gemv_config
from workbench.variants.attention import TRITON_CONFIGS as ATTENTION_CONFIGS
from workbench.variants.attention import _triton_supports as _attention_supports
from workbench.variants.attn_out import _GATED_GEMV_MAX_TOKENS, _attn_out_triton_supports

# The decode lock's attention config (17 splits of 32 keys over a 512-key window) and o_proj tile
# (runs/optimize-decode-b1-beam-501b-tp8/lock.yaml), then attention's default and its 32K-context
# winner (runs/bench-attention-tp8/) with a whole o_proj row a step.
CONFIGS = [
    dict(attention=ATTENTION_CONFIGS[5], gemv=gemv_config(4, 256)),
    dict(attention=ATTENTION_CONFIGS[0], gemv=gemv_config(4, 1024)),
    dict(attention=ATTENTION_CONFIGS[6], gemv=gemv_config(4, 256)),
]


def _supports(wl):
    for verdict in (_attention_supports(wl), _attn_out_triton_supports(wl)):
        if verdict is not True:
            return verdict
    return True


def _at(config=None):
    config = config or CONFIGS[0]
    pdl = bool(config.get("pdl"))
    attention_cfg, gemv_cfg = {**config["attention"], "pdl": pdl}, {**config["gemv"], "pdl": pdl}

    def attention_out_triton(q, cache, meta, g, w, *, window, scale):
        # kernels: imported on use (they need triton, and TRITON_INTERPRET set first on the CPU)
        from workbench.variants.kernels.attention import paged_attention
        from workbench.variants.kernels.attention_gated_merge import decode_gated
        from workbench.variants.kernels.gemv import linear
        from workbench.variants.attn_out import _attn_gate

        if meta.decode and 0 < q.shape[0] <= _GATED_GEMV_MAX_TOKENS:  # static shape dispatch: graph-safe
            gated = decode_gated(q, cache, meta, g, w["gate_bias"], window=window, scale=scale, cfg=attention_cfg)
            return linear(gated, w["o_proj"].contiguous(), gemv_cfg)
        o = paged_attention(q, cache, meta, window=window, scale=scale, config=attention_cfg)
        return F.linear(_attn_gate(o, g, w["gate_bias"], pdl=pdl), w["o_proj"])
    return attention_out_triton


register("attention_out", "triton", "triton", supports=_supports, configs=CONFIGS, configure=_at, pdl=True)(_at())
