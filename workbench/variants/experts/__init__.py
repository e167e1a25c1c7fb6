"""`experts`: the routed experts of a MoE layer and the weighted combine.

Contract: `experts(x, ids, weights, w) -> y`; x [N, hidden]; ids [N, top_k] int, weights [N, top_k]
FP32 from `route`; w {"gate_proj", "up_proj": [E, ff, hidden], "down_proj": [E, hidden, ff]}.
y[n] = sum_k weights[n, k] * SwiGLU_{ids[n, k]}(x[n]); each expert's GEMMs in the model dtype with
the activation in FP32 (rounded once), the combine in FP32, rounded once. y [N, hidden].

The reference picks a plain-PyTorch strategy by the (static) token count; all three compute the
same function and tests hold them to each other:
- few tokens: gather each token's experts (reads only the selected experts; graph-capturable);
- up to 256 tokens: loop over all experts with a dense combine matrix (graph-capturable);
- more (prefill): group tokens by expert (host sync; prefill is not graph-captured).
"""

import torch

from beam_model.functional import swiglu
from beam_model.quant.tensors import dense
from workbench.points import Call, PointSpec, declare
from workbench.registry import register
from workbench.variants.inputs import DTYPE_BYTES, Rand, weight_bytes

DENSE_MAX_TOKENS = 256
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
QUANTIZED = {"fp8": PROJECTIONS, "nvfp4": PROJECTIONS}


def _gathered(x, ids, weights, w):
    # [N, K, ...]: only the selected experts' weights, dequantized where they are stored quantized
    wg, wu, wd = (dense(w[k][ids], x.dtype) for k in PROJECTIONS)
    g = torch.einsum("nh,nkfh->nkf", x, wg).float()
    u = torch.einsum("nh,nkfh->nkf", x, wu).float()
    a = (torch.nn.functional.silu(g) * u).to(x.dtype)
    y = torch.einsum("nkf,nkhf->nkh", a, wd)
    return (y.float() * weights[..., None]).sum(1)


def _dense(x, ids, weights, w):
    combine = torch.zeros(x.shape[0], w["gate_proj"].shape[0], device=x.device, dtype=torch.float32)
    combine.scatter_(1, ids, weights.float())
    out = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
    for e in range(combine.shape[1]):
        y = swiglu(x, w["gate_proj"][e], w["up_proj"][e], w["down_proj"][e])
        out += combine[:, e:e + 1] * y.float()
    return out


def _grouped(x, ids, weights, w):
    top_k = ids.shape[1]
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=w["gate_proj"].shape[0]).tolist()
    out = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
    start = 0
    for e, c in enumerate(counts):
        if c:
            pairs = order[start:start + c]
            tokens = pairs // top_k
            y = swiglu(x[tokens], w["gate_proj"][e], w["up_proj"][e], w["down_proj"][e])
            out.index_add_(0, tokens, y.float() * weights.flatten()[pairs, None].float())
            start += c
    return out


@register("experts", "torch", "torch")
def experts(x, ids, weights, w):
    n, top_k = ids.shape
    if n * top_k <= w["gate_proj"].shape[0]:
        out = _gathered(x, ids, weights, w)
    elif n <= DENSE_MAX_TOKENS:
        out = _dense(x, ids, weights, w)
    else:
        out = _grouped(x, ids, weights, w)
    return out.to(x.dtype)


# ---- spec: inputs, roofline and tolerance for the harness ------------------------------------------


def _inputs(wl, device, seed):
    c, r = wl.config, Rand("experts", wl, device, seed)
    h, f, e, n = c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, wl.tokens
    ids = r.uniform(n, e).topk(c.num_experts_per_tok, dim=-1).indices  # distinct experts per token
    scores = 0.1 + 0.9 * r.uniform(n, c.num_experts_per_tok)  # sigmoid-like scores, renormalised as route does
    weights = scores / scores.sum(-1, keepdim=True) * c.routed_scaling_factor
    w = {"gate_proj": r.linear(e, f, h), "up_proj": r.linear(e, f, h), "down_proj": r.linear(e, h, f)}
    return Call((r.normal(n, h), ids, weights, w), weights_arg=3)


def _bytes(wl):
    c, n, k = wl.config, wl.tokens, wl.config.num_experts_per_tok
    touched = min(c.n_routed_experts, n * k)  # at small batch only the selected experts' weights move
    return DTYPE_BYTES[wl.dtype] * 2 * n * c.hidden_size + 12 * n * k \
        + touched * 3 * weight_bytes(wl, QUANTIZED, c.moe_intermediate_size, c.hidden_size)


declare(PointSpec(
    "experts", _inputs, bytes=_bytes,
    flops=lambda wl: 6 * wl.tokens * wl.config.num_experts_per_tok * wl.config.hidden_size
    * wl.config.moe_intermediate_size,
    # BF16 capped at 1e-2: 1.6x the reference's worst vs FP64 (two roundings in the SwiGLU chain)
    tolerance={"fp32": 1e-5, "fp16": 1.5e-3, "bf16": 1e-2},
    # per-token E4M3 activations (its triton_fp8_grouped): 2x the worst norm-wise error measured on FP8
    # weights, random and beam-mini's on text (runs/fp8-activation-error-cpu/errors.json)
    activation_tolerance={"fp8": 0.10},
    quantized=QUANTIZED,
))

