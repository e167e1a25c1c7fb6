"""`qkvg_proj:packed_views`: one GEMM on the packed q/k/v/gate weight (`pack_qkvg`), its four outputs
returned as column views of the one [N, q+k+v+gate] result.

`qkvg_proj:packed` copies the four column ranges out into contiguous tensors, which reads and writes
the whole output once more: at a prompt's sizes that copy costs about what one GEMM over the packed
weight saves against four, and the search found them even (runs/optimize-prefill-8x2k-beam-501b-tp8/
report.md). The point's contract fixes each output's shape and dtype, not its row stride, and every
consumer honours one: the references view only the last dimension, the kernels of qk_prep and
attn_out take the row stride as an argument (tests/test_qkvg_views.py runs every consumer variant on
such views, with NaN between the columns, against contiguous copies).

A module of its own rather than a section of qkvg_proj.py: qkvg_proj.py is the point's reference
module, whose bytes key the reference profile and torch.compile baselines of every run folder.
"""

import torch.nn.functional as F

from workbench.registry import register
from workbench.variants.qkvg_proj import pack_qkvg


@register("qkvg_proj", "packed_views", "torch", prepare=pack_qkvg)
def qkvg_packed_views(x, w):
    return tuple(F.linear(x, w["qkvg"]).split(w["sizes"], dim=1))
