"""`head:triton_softcap`: the final norm and the LM-head GEMM in torch, then the soft-cap in one Triton
pass over the logits (`_softcap_kernel`, in place when they are FP32), replacing torch's elementwise
chain (float(), divide, tanh, multiply).

Imports without triton (`triton_common.jit` leaves plain functions): the variant is registered either
way and the registry reports the backend as unavailable.
"""

import torch
import torch.nn.functional as F

from beam_model.functional import rms_norm
from workbench.registry import register
from workbench.variants.kernels.softcap import tanh_softcap
from workbench.variants.kernels.triton_common import jit as _jit
from workbench.variants.kernels.triton_common import pdl_enter, pdl_launch, tl, triton


@_jit
def _softcap_kernel(z_ptr, out_ptr, numel, cap, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Soft-cap over the logits in one pass: reads the GEMM output once, writes FP32 once."""
    pdl_enter(PDL)
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    z = tl.load(z_ptr + o, mask=o < numel, other=0.0).to(tl.float32)
    tl.store(out_ptr + o, tanh_softcap(z, cap), mask=o < numel)


CONFIGS = [dict(block=2048, num_warps=4), dict(block=4096, num_warps=8), dict(block=1024, num_warps=4)]


def _head_softcap_at(cfg):
    def head_triton_softcap(h, w, *, eps, softcap):
        z = F.linear(rms_norm(h, w["norm"], eps).to(h.dtype), w["lm_head"])
        out = z if z.dtype == torch.float32 else torch.empty(z.shape, dtype=torch.float32, device=z.device)
        if z.numel():
            _softcap_kernel[(triton.cdiv(z.numel(), cfg["block"]),)](
                z, out, z.numel(), float(softcap), BLOCK=cfg["block"], num_warps=cfg["num_warps"],
                **pdl_launch(cfg.get("pdl")))
        return out

    return head_triton_softcap


def _supports(wl):
    if wl.dtype not in ("bf16", "fp16", "fp32"):
        return f"head:triton_softcap takes bf16/fp16/fp32 logits, not {wl.dtype}"
    if wl.tokens * wl.config.vocab_size >= 2 ** 31:
        return "head:triton_softcap indexes with int32: tokens x vocab must stay below 2^31"
    return True


register("head", "triton_softcap", "triton", supports=_supports, configs=CONFIGS,
         pdl=True, configure=_head_softcap_at)(_head_softcap_at(CONFIGS[0]))
