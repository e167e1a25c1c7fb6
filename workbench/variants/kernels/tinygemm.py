"""FlashInfer's `tinygemm_bf16` behind `qkvg_proj:flashinfer` and `attn_out:flashinfer`.

`flashinfer.gemm.tinygemm_bf16(input, weight, out)` (SM90+) is a latency-optimised small-M GEMM
adapted from TensorRT-LLM's tinygemm2: out = input @ weight.T with BF16 operands and output and FP32
accumulation, one rounding: F.linear's semantics, as the references compute their projections. It
takes input features in multiples of 64 and output features in multiples of 16, and is made for
1-8 rows: the variants send it decode rows (up to MAX_TOKENS) and a prompt's rows to cuBLAS.

With PDL (`use_pdl`), the kernel issues its first weight tiles' TMA loads before it waits for the
previous kernel, and lets the next kernel launch once that wait is over.

FlashInfer is imported on the first call: this module must import without it (docs/decisions.md #25).
"""

import torch

MAX_TOKENS = 16


def tinygemm_limits(wl, in_features: int, out_features: int) -> bool | str:
    """True, or why `tinygemm_bf16` cannot take this GEMM (its documented constraints)."""
    if wl.dtype != "bf16":
        return f"tinygemm_bf16 takes bf16, not {wl.dtype}"
    if in_features % 64:
        return f"{in_features} input features are not a multiple of 64 (tinygemm_bf16)"
    if out_features % 16:
        return f"{out_features} output features are not a multiple of 16 (tinygemm_bf16)"
    return True


def tinygemm(x: torch.Tensor, weight: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """x @ weight.T for a few BF16 rows, through FlashInfer (`pdl`: launched with programmatic
    dependent launch; the weight is never written, so it may be read before the kernel's wait)."""
    from flashinfer.gemm import tinygemm_bf16

    x = x if x.is_contiguous() else x.contiguous()
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    tinygemm_bf16(x, weight, out, use_pdl=pdl)
    return out
