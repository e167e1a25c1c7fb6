"""`qkvg_proj:flashinfer`: the packed q/k/v/gate weight through FlashInfer's `tinygemm_bf16`.

`flashinfer.gemm.tinygemm_bf16(input, weight, out)` (SM90+) is a latency-optimised small-M GEMM
adapted from TensorRT-LLM's tinygemm2: out = input @ weight.T with BF16 operands and output and FP32
accumulation, one rounding: F.linear's semantics, as the reference computes each projection. It
takes input features in multiples of 64 and output features in multiples of 16, and is made for
1-8 rows: decode rows (up to MAX_TOKENS) go through it, a prompt's rows through one cuBLAS GEMM on
the same packed weight (`packed`), so a decode-searched lock also serves prefill steps.

With PDL (the registry's "pdl" configs, `use_pdl`), the kernel issues its first weight tiles' TMA loads
before it waits for the previous kernel, and lets the next kernel launch once that wait is over.

A module of its own rather than a section of qkvg_proj.py: adding a variant there would change the
source hash of every variant of the point, and so stale every lock that holds one.
"""

import functools

import torch

from workbench.registry import register
from workbench.variants.qkvg_proj import pack_qkvg, qkvg_packed

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


def _supports(wl):
    c = wl.config
    return tinygemm_limits(wl, c.hidden_size, 2 * c.q_width + 2 * c.kv_width)


def _qkvg_flashinfer_at(x, w, *, pdl=False):
    if not 0 < x.shape[0] <= MAX_TOKENS:
        return qkvg_packed(x, w)
    y = tinygemm(x, w["qkvg"], pdl)
    if y.shape[0] == 1:  # one row: each segment is a contiguous view
        return tuple(t.view(1, -1) for t in y.view(-1).split(w["sizes"]))
    return tuple(t.contiguous() for t in y.split(w["sizes"], dim=1))


@register("qkvg_proj", "flashinfer", "flashinfer", prepare=pack_qkvg, supports=_supports, pdl=True,
          configure=lambda cfg: functools.partial(_qkvg_flashinfer_at, pdl=cfg.get("pdl", False)))
def qkvg_flashinfer(x, w):
    """Decode rows through tinygemm_bf16 on the packed weight; more rows through `packed`."""
    return _qkvg_flashinfer_at(x, w)
