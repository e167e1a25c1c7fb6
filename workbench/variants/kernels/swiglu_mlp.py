"""What the Triton variants of the dense SwiGLU MLP (`dense_mlp:triton`, `dense_mlp:triton_gemv`) share:
the load-time weight layout they read (`pack_gate_up`) and the dtypes they take (`supports_triton`).

Imports no triton at import time: the variant modules register either way and the registry reports a
missing backend; the split-K counters come from `gemv.py` when the weights are prepared.
"""

import torch


def pack_gate_up(w):
    """Weight-layout transform (load time): [gate; up] as one [2*ff, hidden] matrix, so one GEMM (one
    weight stream, one read of x) makes both, and row r of gate sits ff rows before row r of up."""
    from workbench.variants.kernels.gemv import new_locks

    return {"gate_up": torch.cat([w["gate_proj"], w["up_proj"]]).contiguous(), "down": w["down_proj"].contiguous(),
            "locks": new_locks(w["down_proj"].device)}


def supports_triton(wl):
    if wl.dtype not in ("bf16", "fp16", "fp32"):
        return f"the Triton kernels take bf16/fp16/fp32, not {wl.dtype}"
    return True
