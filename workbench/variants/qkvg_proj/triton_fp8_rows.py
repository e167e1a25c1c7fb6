"""`qkvg_proj:triton_fp8_rows`: the four projections on FP8 weights in one launch on their packed rows
(`kernels/packed_qkvg.py`), through the whole-row FP8 GEMV (`kernels/gemv_fp8_rows.py`: each program's rows
and scales read before its PDL wait). Reads only FP8 weights; only decode sizes are offered to it (up to
`gemv_fp8_rows.ROWS` rows); past them it still computes the contract (`gemv_fp8`'s row tiles, then a
dequantized GEMM).
"""

import functools

from workbench.registry import register
from workbench.variants.kernels.gemv_fp8_rows import CONFIGS, fp8_rows_linear, supports
from workbench.variants.kernels.packed_qkvg import pack_qkvg, split_qkvg


def qkvg_triton_fp8_rows(x, w, cfg=CONFIGS[0]):
    return split_qkvg(fp8_rows_linear(x, w["qkvg"], cfg), w["sizes"])


register("qkvg_proj", "triton_fp8_rows", "triton", supports=supports("qkvg_proj:triton_fp8_rows"), configs=CONFIGS,
         configure=lambda cfg: functools.partial(qkvg_triton_fp8_rows, cfg=cfg), prepare=pack_qkvg,
         pdl=True, formats=("fp8",))(qkvg_triton_fp8_rows)
