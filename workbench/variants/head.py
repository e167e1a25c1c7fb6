"""`head`: final RMSNorm -> LM head -> logit soft-cap.

Contract: `head(h, w, *, eps, softcap) -> logits`; h [N, hidden] residual stream; w {"norm":
[hidden], "lm_head": [vocab, hidden]}; norm in FP32 rounded to the model dtype, GEMM in the model
dtype, soft-cap `cap * tanh(z / cap)` in FP32. Returns FP32 logits [N, vocab] (this rank's slice
of the vocabulary under tensor parallelism).
"""

import torch.nn.functional as F

from beam_model.functional import rms_norm, soft_cap
from workbench.registry import register


@register("head", "torch", "torch")
def head(h, w, *, eps, softcap):
    x = rms_norm(h, w["norm"], eps).to(h.dtype)
    return soft_cap(F.linear(x, w["lm_head"]), softcap)
