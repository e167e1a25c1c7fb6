"""attention_out:triton's kernel sequence, which the other `attention_out` variants run where their own
kernels do not apply. At decode (1-GATED_GEMV_MAX_TOKENS rows): attention:triton's split-K decode
kernel, the merge-gate kernel (`kernels/attention_gated_merge.py`) and the o_proj GEMV
(`kernels/gemv.py`), three launches; otherwise (prefill, more decode rows) attention:triton, the gate
kernel (`kernels/output_gate.py`) and F.linear.

Imports without triton: the kernels are imported on the first call (they need triton, and
TRITON_INTERPRET set first on the CPU). Never imports a point package.
"""

import torch.nn.functional as F

from workbench.variants.kernels.attention_configs import supports as attention_supports
from workbench.variants.kernels.output_gate import GATED_GEMV_MAX_TOKENS, output_gate
from workbench.variants.kernels.output_gate import supports as gate_supports


def supports(wl):
    """Both members' limits: the Triton attention kernels' and the output gate's."""
    for verdict in (attention_supports(wl), gate_supports(wl)):
        if verdict is not True:
            return verdict
    return True


def launch_configs(config: dict) -> tuple[bool, dict, dict]:
    """(pdl, attention config, o_proj GEMV config) of an attention_out config: its `attention` and
    `gemv` entries, each with the config's "pdl", which applies to every launch."""
    pdl = bool(config.get("pdl"))
    return pdl, {**config["attention"], "pdl": pdl}, {**config["gemv"], "pdl": pdl}


def three_launches(q, cache, meta, g, w, *, window, scale, attention_cfg: dict, gemv_cfg: dict, pdl: bool):
    """The `attention_out` contract by the sequence above, at the configs `launch_configs` gives."""
    from workbench.variants.kernels.attention import paged_attention
    from workbench.variants.kernels.attention_gated_merge import decode_gated
    from workbench.variants.kernels.gemv import linear

    if meta.decode and 0 < q.shape[0] <= GATED_GEMV_MAX_TOKENS:  # static shape dispatch: graph-safe
        gated = decode_gated(q, cache, meta, g, w["gate_bias"], window=window, scale=scale, cfg=attention_cfg)
        return linear(gated, w["o_proj"].contiguous(), gemv_cfg)
    o = paged_attention(q, cache, meta, window=window, scale=scale, config=attention_cfg)
    return F.linear(output_gate(o, g, w["gate_bias"], pdl=pdl), w["o_proj"])
