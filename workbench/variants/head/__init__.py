"""`head`: final RMSNorm -> LM head -> logit soft-cap.

Contract: `head(h, w, *, eps, softcap) -> logits`; h [N, hidden] residual stream; w {"norm":
[hidden], "lm_head": [vocab, hidden]}; norm in FP32 rounded to the model dtype, GEMM in the model
dtype, soft-cap `cap * tanh(z / cap)` in FP32. Returns FP32 logits [N, vocab] (this rank's slice
of the vocabulary under tensor parallelism).
"""

import math

import torch.nn.functional as F

from beam_model.functional import rms_norm, soft_cap
from workbench.points import Call, PointSpec, declare
from workbench.registry import register
from workbench.variants.inputs import DTYPE_BYTES, Rand


@register("head", "torch", "torch")
def head(h, w, *, eps, softcap):
    x = rms_norm(h, w["norm"], eps).to(h.dtype)
    return soft_cap(F.linear(x, w["lm_head"]), softcap)


# ---- spec: inputs, roofline and tolerance for the harness ------------------------------------------


def _inputs(wl, device, seed):
    c, r = wl.config, Rand("head", wl, device, seed)
    h = c.hidden_size
    # LM head std 10/sqrt(hidden) as in weights.py: logits reach the soft-cap's curved range.
    w = {"norm": r.norm(h), "lm_head": r.normal(c.vocab_size, h, std=10.0 / math.sqrt(h))}
    return Call((r.normal(wl.tokens, h), w), dict(eps=c.rms_norm_eps, softcap=c.final_logit_softcapping),
                weights_arg=1)


def _bytes(wl):
    c = wl.config
    return DTYPE_BYTES[wl.dtype] * (wl.tokens + 1 + c.vocab_size) * c.hidden_size + 4 * wl.tokens * c.vocab_size


declare(PointSpec(
    "head", _inputs, bytes=_bytes,
    flops=lambda wl: 2 * wl.tokens * wl.config.hidden_size * wl.config.vocab_size,
    tolerance={"fp32": 1e-5, "fp16": 8e-4, "bf16": 6e-3},  # ~2.5x the reference's worst vs FP64
))
