"""`boundary`: [all-reduce] -> post-norm -> depth-scaled residual -> next pre-norm.

Contract: `boundary(y, h, w, *, eps, group=None) -> (h_new, x_next)`.
- y [N, hidden]: the sub-layer's output (a partial sum per rank under tensor parallelism).
- h [N, hidden]: the residual stream, model dtype. Neither input is modified.
- w: {"post_norm": [hidden], "next_norm": [hidden] or None (after the last sub-layer),
  "residual": FP32 [2] = (a, b) of this site's depth-scaled add h <- a*h + b*y, from
  `residual_coefficients(k)` for the k-th add (k = 1..2*layers)}. Keeping the per-site constants
  in `w` gives all 104 sites one signature (one compiled graph, one kernel specialisation).
- eps: RMSNorm epsilon; group: TP process group (None on one GPU: no all-reduce).
Numerics: all-reduce in the model dtype; post-norm and the residual add in FP32, rounded once to
give h_new; x_next = RMSNorm(h_new as stored) in FP32, rounded once. None when next_norm is None.
"""

import torch

from beam_model.functional import residual_coefficients, rms_norm
from workbench.points import Call, PointSpec, declare
from workbench.registry import register
from workbench.variants.inputs import DTYPE_BYTES, Rand
from workbench.variants.kernels.tensor_parallel import all_reduced


@register("boundary", "torch", "torch")
def boundary(y, h, w, *, eps, group=None):
    y = all_reduced(y, group)
    a, b = w["residual"][0], w["residual"][1]
    h_new = (a * h.float() + b * rms_norm(y, w["post_norm"], eps)).to(h.dtype)
    if w["next_norm"] is None:
        return h_new, None
    return h_new, rms_norm(h_new, w["next_norm"], eps).to(h.dtype)


# ---- spec: inputs, roofline and tolerance for the harness ------------------------------------------


def _inputs(wl, device, seed):
    c, r = wl.config, Rand("boundary", wl, device, seed)
    hidden, n = c.hidden_size, wl.tokens
    # Any site but the last (no next norm there; captured calls of the last layer cover that case).
    k = 1 + seed % (c.num_residual_adds - 1)
    w = {"post_norm": r.norm(hidden), "next_norm": r.norm(hidden),
         "residual": torch.tensor(residual_coefficients(k), dtype=torch.float32, device=r.device)}
    return Call((r.normal(n, hidden), r.normal(n, hidden), w), dict(eps=c.rms_norm_eps), weights_arg=2)


declare(PointSpec(
    "boundary", _inputs,
    bytes=lambda wl: DTYPE_BYTES[wl.dtype] * (4 * wl.tokens + 2) * wl.config.hidden_size + 8,  # y, h in; h, x out
    flops=lambda wl: 12 * wl.tokens * wl.config.hidden_size,  # two norms + the scaled add, per element
    tolerance={"fp32": 1e-5, "fp16": 1e-3, "bf16": 8e-3},  # ~2.5x the reference's worst vs FP64
    partial_sum=0,  # y
))
