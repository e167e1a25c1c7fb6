"""The packed q/k/v/gate weight that `qkvg_proj`'s variants other than the reference read: one
[q+k+v+gate, hidden] matrix, so one GEMM reads x once and the four weights as one stream.

Torch only: imports no triton, cutlass or flashinfer, so every variant module can import it.
"""

import torch

PARTS = ("q_proj", "k_proj", "v_proj", "gate_proj")


def pack_qkvg(w):
    """Weight-layout transform (load time): q, k, v and gate stacked into one [q+k+v+gate, hidden]
    matrix, so one GEMM reads x once and the weights as one stream. Costs a second copy of these
    weights while the model keeps its separate ones."""
    return {"qkvg": torch.cat([w[p] for p in PARTS]).contiguous(), "sizes": tuple(w[p].shape[0] for p in PARTS)}
