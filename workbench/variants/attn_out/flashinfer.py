"""`attn_out:flashinfer`: the Triton output-gate kernel, then o_proj through FlashInfer's `tinygemm_bf16`
for decode rows (`kernels/tinygemm.py` has the kernel and its constraints); a prompt's rows take
cuBLAS, as `attn_out:triton` does. Its "pdl" configs launch both kernels with programmatic dependent
launch."""

import functools

import torch.nn.functional as F

from workbench.registry import register
from workbench.variants.kernels.output_gate import output_gate
from workbench.variants.kernels.tinygemm import MAX_TOKENS, tinygemm, tinygemm_limits


def _supports(wl):
    return tinygemm_limits(wl, wl.config.q_width, wl.config.hidden_size)


def _attn_out_flashinfer_at(o, g, w, *, pdl=False):
    gated = output_gate(o, g, w["gate_bias"], pdl=pdl)
    if not 0 < gated.shape[0] <= MAX_TOKENS:
        return F.linear(gated, w["o_proj"])
    return tinygemm(gated, w["o_proj"], pdl)


@register("attn_out", "flashinfer", "flashinfer", supports=_supports, pdl=True,
          configure=lambda cfg: functools.partial(_attn_out_flashinfer_at, pdl=cfg.get("pdl", False)))
def attn_out_flashinfer(o, g, w):
    return _attn_out_flashinfer_at(o, g, w)
