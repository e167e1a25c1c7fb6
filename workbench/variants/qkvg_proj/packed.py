"""`qkvg_proj:packed`: one cuBLAS GEMM on the packed q/k/v/gate weight (`kernels/packed_qkvg.py`), its
[N, q+k+v+gate] result split into four contiguous outputs.

Also the prompt path of `qkvg_proj:cute` and `qkvg_proj:flashinfer`, whose kernels take decode rows only.
"""

import torch.nn.functional as F

from workbench.registry import register
from workbench.variants.kernels.packed_qkvg import pack_qkvg, split_qkvg


@register("qkvg_proj", "packed", "torch", prepare=pack_qkvg)
def qkvg_packed(x, w):
    """One GEMM on the packed weight, its output split into the four (`split_qkvg`)."""
    return split_qkvg(F.linear(x, w["qkvg"]), w["sizes"])
