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
import torch.distributed as dist

from beam_model.functional import rms_norm
from workbench.registry import register


@register("boundary", "torch", "torch")
def boundary(y, h, w, *, eps, group=None):
    if group is not None:
        y = y.clone()
        dist.all_reduce(y, group=group)
    a, b = w["residual"][0], w["residual"][1]
    h_new = (a * h.float() + b * rms_norm(y, w["post_norm"], eps)).to(h.dtype)
    if w["next_norm"] is None:
        return h_new, None
    return h_new, rms_norm(h_new, w["next_norm"], eps).to(h.dtype)
