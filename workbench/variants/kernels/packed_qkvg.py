"""The packed q/k/v/gate weight that `qkvg_proj`'s variants other than the reference read: one
[q+k+v+gate, hidden] matrix, so one GEMM reads x once and the four weights as one stream.

Torch only (and the model's quantized weight types): imports no triton, cutlass or flashinfer, so every
variant module can import it.
"""

import torch

from beam_model.quant.tensors import Fp8Weight

PARTS = ("q_proj", "k_proj", "v_proj", "gate_proj")


def pack_qkvg(w):
    """Weight-layout transform (load time): q, k, v and gate stacked into one [q+k+v+gate, hidden]
    matrix, so one GEMM reads x once and the weights as one stream; FP8 weights stack their E4M3 rows
    and their row scales alike. Costs a second copy of these weights while the model keeps its
    separate ones."""
    parts = [w[p] for p in PARTS]
    sizes = tuple(t.shape[0] for t in parts)
    if all(isinstance(t, Fp8Weight) for t in parts):
        return {"qkvg": Fp8Weight(torch.cat([t.weight for t in parts]).contiguous(),
                                  torch.cat([t.scale for t in parts]).contiguous()), "sizes": sizes}
    return {"qkvg": torch.cat(parts).contiguous(), "sizes": sizes}


def split_qkvg(y, sizes):
    """The packed GEMM's [N, q+k+v+gate] output as four contiguous outputs: column slices are contiguous
    only for N = 1 (free views); for N > 1 one split-copy makes them."""
    if y.shape[0] == 1:
        return tuple(t.view(1, -1) for t in y.view(-1).split(sizes))
    outs = [y.new_empty(y.shape[0], s) for s in sizes]
    torch.split_with_sizes_copy(y, list(sizes), dim=1, out=outs)
    return tuple(outs)
