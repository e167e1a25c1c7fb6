"""`qkvg_proj:packed`: one cuBLAS GEMM on the packed q/k/v/gate weight (`kernels/packed_qkvg.py`), its
[N, q+k+v+gate] result split into four contiguous outputs.

Also the prompt path of `qkvg_proj:cute` and `qkvg_proj:flashinfer`, whose kernels take decode rows only.
"""

import torch
import torch.nn.functional as F

from workbench.registry import register
from workbench.variants.kernels.packed_qkvg import pack_qkvg


@register("qkvg_proj", "packed", "torch", prepare=pack_qkvg)
def qkvg_packed(x, w):
    """One GEMM on the packed weight. Column slices of its [N, total] output are contiguous only for
    N = 1 (free views); for N > 1 one split-copy makes the four contiguous outputs."""
    y = F.linear(x, w["qkvg"])
    if y.shape[0] == 1:
        return tuple(t.view(1, -1) for t in y.view(-1).split(w["sizes"]))
    outs = [y.new_empty(y.shape[0], s) for s in w["sizes"]]
    torch.split_with_sizes_copy(y, list(w["sizes"]), dim=1, out=outs)
    return tuple(outs)
