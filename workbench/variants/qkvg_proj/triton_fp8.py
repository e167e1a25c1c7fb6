"""`qkvg_proj:triton_fp8`: the four projections on FP8 weights through the weight-only FP8 GEMV
(`kernels/gemv_fp8.py`), one launch on their packed rows (`kernels/packed_qkvg.py`: E4M3 rows and row
scales stacked at load time), so the k and v projections' few rows do not each take a launch that fills
a fraction of the GPU. It reads the E4M3 bytes as stored and applies the row scales once after the
reduction. Reads only FP8 weights (docs/decisions.md #42), and only decode sizes are
offered to it (up to `gemv_fp8.MAX_ROWS` rows); past them it still computes the contract.

The kernel is imported on the first call: this module must import without triton, and under the CPU
interpreter TRITON_INTERPRET must be set before the kernel is defined.
"""

import functools

from workbench.registry import register
from workbench.variants.kernels.fp8_decode import CONFIGS, decode_supports
from workbench.variants.kernels.packed_qkvg import pack_qkvg, split_qkvg


def qkvg_triton_fp8(x, w, cfg=CONFIGS[0]):
    from workbench.variants.kernels.gemv_fp8 import fp8_linear  # kernels: imported on use

    return split_qkvg(fp8_linear(x, w["qkvg"], cfg), w["sizes"])


register("qkvg_proj", "triton_fp8", "triton", supports=decode_supports("qkvg_proj:triton_fp8"), configs=CONFIGS,
         configure=lambda cfg: functools.partial(qkvg_triton_fp8, cfg=cfg), prepare=pack_qkvg,
         pdl=True, formats=("fp8",))(qkvg_triton_fp8)
