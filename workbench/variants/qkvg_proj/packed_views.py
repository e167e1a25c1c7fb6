"""`qkvg_proj:packed_views`: one GEMM on the packed q/k/v/gate weight (`kernels/packed_qkvg.py`), its four
outputs returned as column views of the one [N, q+k+v+gate] result.

`qkvg_proj:packed` copies the four column ranges out into contiguous tensors, which reads and writes
the whole output once more: at a prompt's sizes that copy costs about what one GEMM over the packed
weight saves against four. The point's contract fixes each output's shape and dtype, not its row
stride, and every consumer honours one: the references view only the last dimension, the kernels of
qk_prep and attn_out take the row stride as an argument (tests/variants/test_qkvg_views.py runs every
consumer variant on such views, with NaN between the columns, against contiguous copies).
"""

import torch.nn.functional as F

from workbench.registry import register
from workbench.variants.kernels.packed_qkvg import pack_qkvg


@register("qkvg_proj", "packed_views", "torch", prepare=pack_qkvg)
def qkvg_packed_views(x, w):
    return tuple(F.linear(x, w["qkvg"]).split(w["sizes"], dim=1))
