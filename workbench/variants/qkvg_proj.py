"""`qkvg_proj`: the attention sub-layer's input projections.

Contract: `qkvg_proj(x, w) -> (q, k, v, g)`; x [N, hidden]; w {"q_proj", "k_proj", "v_proj",
"gate_proj"} as [out, in] matrices; q and g [N, heads*head_dim], k and v [N, kv_heads*head_dim],
all in the model dtype (GEMMs accumulate in FP32, round once).
"""

import torch.nn.functional as F

from workbench.registry import register


@register("qkvg_proj", "torch", "torch")
def qkvg_proj(x, w):
    return F.linear(x, w["q_proj"]), F.linear(x, w["k_proj"]), F.linear(x, w["v_proj"]), F.linear(x, w["gate_proj"])
