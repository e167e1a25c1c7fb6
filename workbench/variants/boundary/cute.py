"""`boundary:cute`: the one-row-per-CTA boundary kernel in the CuTe DSL, with 16-byte accesses
(`kernels/cute_boundary.py`), after the all-reduce.

The kernel module imports cutlass, so it is imported by the variant's first call: this module must
import without it (docs/decisions.md #25); the registry reports the backend as unavailable.
"""

import functools

from workbench.registry import register
from workbench.variants.kernels.cute_common import vector_rows_supported
from workbench.variants.kernels.tensor_parallel import all_reduced

MAX_HIDDEN = 16384  # the row stays in registers between the two norms
# Threads per row; 20 warps give one vector per thread at hidden 5120 (beam-501b).
CONFIGS = [{"num_warps": 4}, {"num_warps": 8}, {"num_warps": 16}, {"num_warps": 20}]


def _boundary_cute_at(y, h, w, *, eps, group=None, num_warps=4):
    y = all_reduced(y, group)
    from workbench.variants.kernels import cute_boundary

    return cute_boundary.boundary(y, h, w["post_norm"], w["next_norm"], w["residual"], eps=eps, num_warps=num_warps)


def _supports(workload):
    hidden = workload.config.hidden_size
    if hidden > MAX_HIDDEN:
        return f"hidden {hidden} > {MAX_HIDDEN}: a row must fit one CTA's registers"
    return vector_rows_supported(workload)


@register("boundary", "cute", "cute", supports=_supports, configs=CONFIGS,
          configure=lambda cfg: functools.partial(_boundary_cute_at, **cfg))
def boundary_cute(y, h, w, *, eps, group=None):
    """One CuTe DSL kernel per row: RMSNorm(y) -> a*h + b*(.) -> round -> RMSNorm(h_new) -> round."""
    return _boundary_cute_at(y, h, w, eps=eps, group=group, **CONFIGS[0])
