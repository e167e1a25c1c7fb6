"""`attn_out:flashinfer`: the Triton output-gate kernel, then o_proj through FlashInfer's `tinygemm_bf16`
for decode rows (see qkvg_proj__flashinfer.py for the kernel and its constraints); a prompt's rows
take cuBLAS, as `attn_out:triton` does. Its "pdl" configs launch both kernels with programmatic dependent
launch. A module of its own so that existing locks stay valid."""

import functools

import torch.nn.functional as F

from workbench.registry import register
from workbench.variants.attn_out import _attn_gate
from workbench.variants.kernels.tinygemm import MAX_TOKENS, tinygemm, tinygemm_limits


def _supports(wl):
    return tinygemm_limits(wl, wl.config.q_width, wl.config.hidden_size)


def _attn_out_flashinfer_at(o, g, w, *, pdl=False):
    gated = _attn_gate(o, g, w["gate_bias"], pdl=pdl)
    if not 0 < gated.shape[0] <= MAX_TOKENS:
        return F.linear(gated, w["o_proj"])
    return tinygemm(gated, w["o_proj"], pdl)


@register("attn_out", "flashinfer", "flashinfer", supports=_supports, pdl=True,
          configure=lambda cfg: functools.partial(_attn_out_flashinfer_at, pdl=cfg.get("pdl", False)))
def attn_out_flashinfer(o, g, w):
    return _attn_out_flashinfer_at(o, g, w)
