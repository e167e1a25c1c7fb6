"""`qkvg_proj:cute`: decode rows (1-16 tokens) of the packed q/k/v/gate weight through the CuTe DSL GEMV
(`kernels/cute_gemv.py`); a prompt's rows through `qkvg_proj:packed` on the same packed weight, so a
decode-searched lock also serves prefill steps.

The kernel module imports cutlass, so it is imported by the variant's first call: this module must
import without it (docs/decisions.md #25); the registry reports a missing backend.
"""

import functools

from workbench.registry import register
from workbench.variants.kernels.cute_common import vector_rows_supported
from workbench.variants.kernels.packed_qkvg import pack_qkvg
from workbench.variants.qkvg_proj.packed import qkvg_packed

MAX_TOKENS = 16  # the per-lane FP32 sums (tokens x rows per warp) are registers
# W rows per warp, warps per CTA, W vectors per lane per step. At TP8 (1792 x 5120) a lane has 20
# vectors of each row; W loads in flight per lane = rows x unroll (twice that across the pipelined
# step), CTAs = 1792 / (rows x warps). Each compiles for sm_90a without local-memory spills at TP8 for
# 1-16 tokens (rows_per_warp 1 with unroll 5, 10 or 20 did not: ptxas held those to 48-80 registers and spilled).
CONFIGS = [
    {"rows_per_warp": 2, "num_warps": 4, "unroll": 5},
    {"rows_per_warp": 2, "num_warps": 2, "unroll": 5},
    {"rows_per_warp": 4, "num_warps": 2, "unroll": 4},
]


def _qkvg_cute_at(x, w, **cfg):
    """Decode rows (at most MAX_TOKENS) through the CuTe GEMV; a prompt's rows through one GEMM
    on the same packed weight (`packed`), so a decode-searched lock also serves prefill steps."""
    if x.shape[0] > MAX_TOKENS:
        return qkvg_packed(x, w)
    from workbench.variants.kernels import cute_gemv

    return cute_gemv.linear(x, w["qkvg"], w["sizes"], **cfg)


@register("qkvg_proj", "cute", "cute", prepare=pack_qkvg, supports=vector_rows_supported, configs=CONFIGS,
          configure=lambda cfg: functools.partial(_qkvg_cute_at, **cfg))
def qkvg_cute(x, w):
    """The packed weight through the CuTe DSL GEMV; q, k, v, g written segment-major into one buffer,
    so all four outputs are contiguous views, as the Triton variant returns them."""
    return _qkvg_cute_at(x, w, **CONFIGS[0])
