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
from workbench.points import Call, PointSpec, declare
from workbench.registry import register
from workbench.variants.inputs import DTYPE_BYTES, Rand

DENSE_MAX_TOKENS = 256


def _gathered(x, ids, weights, w):
    wg, wu, wd = w["gate_proj"][ids], w["up_proj"][ids], w["down_proj"][ids]  # [N, K, ...]
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
    return DTYPE_BYTES[wl.dtype] * (2 * n * c.hidden_size + touched * 3 * c.hidden_size * c.moe_intermediate_size) \
        + 12 * n * k


declare(PointSpec(
    "experts", _inputs, bytes=_bytes,
    flops=lambda wl: 6 * wl.tokens * wl.config.num_experts_per_tok * wl.config.hidden_size
    * wl.config.moe_intermediate_size,
    # BF16 capped at 1e-2: 1.6x the reference's worst vs FP64 (two roundings in the SwiGLU chain)
    tolerance={"fp32": 1e-5, "fp16": 1.5e-3, "bf16": 1e-2},
))


# ---- triton: fused MoE, two kernels per path (workbench/variants/kernels/moe.py) -----------------
# The kernels are imported on the first call: this module must import without triton, and under the
# CPU interpreter TRITON_INTERPRET must be set before they are defined. A config's "path" forces
# GEMV (few pairs: reads only the selected experts) or grouped (tensor-core GEMMs over pairs sorted
# by expert), so the search picks the path at the target's batch (a GEMV config still groups past
# 2048 pairs, where it would re-read each expert per pair); no config picks by size.

TRITON_CONFIGS = [
    # GEMV: BLOCK_N ff rows x BLOCK_K hidden per gate/up step (hidden in SPLIT_K slices, default 1);
    # DOWN_* = hidden rows x ff per down step; DOWN_WARPS (default num_warps) for the down kernel
    dict(path="gemv", BLOCK_N=8, BLOCK_K=512, DOWN_BLOCK_N=16, DOWN_BLOCK_K=64, num_warps=4, num_stages=1),
    dict(path="gemv", BLOCK_N=4, BLOCK_K=1024, DOWN_BLOCK_N=8, DOWN_BLOCK_K=128, num_warps=4, num_stages=1),
    # the H200 sweep's best axes combined (runs/experts-sweep-tp8-b1/): 2 warps, 4 x 64 down tile (the
    # decode lock's choice), then the same with gate/up tiles that do not spill registers at 2 warps
    # on sm_90 (runs/sm90-resources-experts/; the 1024- and 2048-wide ones do, and ran 1.7-2x slower)
    dict(path="gemv", BLOCK_N=8, BLOCK_K=512, DOWN_BLOCK_N=4, DOWN_BLOCK_K=64, num_warps=2, num_stages=1),
    dict(path="gemv", BLOCK_N=8, BLOCK_K=256, DOWN_BLOCK_N=4, DOWN_BLOCK_K=64, num_warps=2, num_stages=1),
    dict(path="gemv", BLOCK_N=4, BLOCK_K=512, DOWN_BLOCK_N=4, DOWN_BLOCK_K=64, num_warps=2, num_stages=1),
    dict(path="gemv", BLOCK_N=2, BLOCK_K=1024, DOWN_BLOCK_N=4, DOWN_BLOCK_K=64, num_warps=2, num_stages=1),
    # 8 x 256 at 2 warps with the default 16 x 64 down tile at 8 warps
    dict(path="gemv", BLOCK_N=8, BLOCK_K=256, DOWN_BLOCK_N=16, DOWN_BLOCK_K=64, num_warps=2, num_stages=1,
         DOWN_WARPS=8),
    # 8 x 256 above with hidden cut in 2 / 4 slices: 2-4x the gate/up programs streaming at once
    dict(path="gemv", BLOCK_N=8, BLOCK_K=256, DOWN_BLOCK_N=4, DOWN_BLOCK_K=64, num_warps=2, num_stages=1, SPLIT_K=2),
    dict(path="gemv", BLOCK_N=8, BLOCK_K=256, DOWN_BLOCK_N=4, DOWN_BLOCK_K=64, num_warps=2, num_stages=1, SPLIT_K=4),
    # grouped: BLOCK_M routed rows x BLOCK_N outputs x BLOCK_K reduction, for both GEMMs unless DOWN_*
    # (BLOCK_N, BLOCK_K, WARPS, STAGES) give the down GEMM its own
    dict(path="grouped", BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    dict(path="grouped", BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    dict(path="grouped", BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4),
    dict(path="grouped", BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(path="grouped", BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3),
    # The 8 x 2K prefill lock's tile (the largest tried was the fastest, runs/optimize-prefill-8x2k-*)
    # with wider down tiles: gate/up's N is ff (320 at TP8: 64 divides it), down's is hidden (5120),
    # and down holds one accumulator where gate/up holds two. None spills on sm_90, and each pipelines
    # its loads (scripts/sm90_resources.py, runs/sm90-resources-experts/)
    dict(path="grouped", BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3, DOWN_BLOCK_N=128),
    dict(path="grouped", BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3, DOWN_BLOCK_N=256,
         DOWN_BLOCK_K=32),
    dict(path="grouped", BLOCK_M=128, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=4, DOWN_BLOCK_N=128,
         DOWN_WARPS=8, DOWN_STAGES=3),
]


def _triton_supports(wl):
    if wl.dtype not in ("bf16", "fp16", "fp32"):
        return f"experts:triton takes bf16, fp16 or fp32 weights, not {wl.dtype}"
    return True  # any hidden / ff / experts / top_k: every tile is masked or wrapped


def _triton_config_supports(config, wl):
    from workbench.variants.kernels.moe import GEMV_HARD_MAX_PAIRS  # kernels: imported on use

    pairs = wl.tokens * wl.config.num_experts_per_tok
    if config["path"] == "gemv" and pairs > GEMV_HARD_MAX_PAIRS:
        return f"{pairs} routed pairs run a GEMV config as the grouped default (GEMV stops at {GEMV_HARD_MAX_PAIRS})"
    return True


def _triton_at(config=None):
    def experts_triton(x, ids, weights, w):
        from workbench.variants.kernels.moe import fused_experts

        return fused_experts(x, ids, weights, w, config)
    return experts_triton


register("experts", "triton", "triton", supports=_triton_supports, configs=TRITON_CONFIGS,
         configure=_triton_at, config_supports=_triton_config_supports, pdl=True)(_triton_at())
