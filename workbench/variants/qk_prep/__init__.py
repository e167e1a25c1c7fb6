"""`qk_prep`: per-head Q/K RMSNorm -> round -> RoPE (sliding layers) or SSMax (full layers) -> KV write.

Contract: `qk_prep(q, k, v, w, *, cache, slot_mapping, positions, eps, rope_theta, ssmax) -> q_out`.
- q [N, heads*hd], k and v [N, kv_heads*hd] in the model dtype; w {"q_norm": [hd], "k_norm": [hd]}.
- cache [pages, 2, page_size, kv_heads, hd]: K and V of token n go to slot `slot_mapping[n]`
  (page = slot // page_size). The cache is the only argument written in place.
- positions [N]: 0-based absolute positions. rope_theta is set on sliding layers (neox RoPE over
  all of hd, angles exact), ssmax = (base, exponent) on full layers: q *= (1 + p/base)^exponent with
  p = position + 1; keys get no position at all on full layers.
Numerics: norms in FP32, rounded to the model dtype, then RoPE / SSMax in FP32, rounded once.
Returns q_out [N, heads, hd] in the model dtype.
"""

from beam_model.functional import apply_rope, rms_norm, rope_cos_sin, ssmax_scale
from workbench.points import Call, PointSpec, declare
from workbench.registry import register
from workbench.variants.inputs import DTYPE_BYTES, Rand, layer_kwargs, paged_kv


@register("qk_prep", "torch", "torch")
def qk_prep(q, k, v, w, *, cache, slot_mapping, positions, eps, rope_theta=None, ssmax=None):
    n, hd = q.shape[0], cache.shape[-1]
    dtype = q.dtype
    qn = rms_norm(q.view(n, -1, hd), w["q_norm"], eps).to(dtype)
    kn = rms_norm(k.view(n, -1, hd), w["k_norm"], eps).to(dtype)
    if rope_theta is not None:
        cos, sin = rope_cos_sin(positions, hd, rope_theta)
        qn = apply_rope(qn, cos, sin).to(dtype)
        kn = apply_rope(kn, cos, sin).to(dtype)
    if ssmax is not None:
        qn = (qn.float() * ssmax_scale(positions, *ssmax)[:, None, None]).to(dtype)
    page_size = cache.shape[2]
    pages, offsets = slot_mapping // page_size, slot_mapping % page_size
    cache[pages, 0, offsets] = kn.to(cache.dtype)
    cache[pages, 1, offsets] = v.view(n, -1, hd).to(cache.dtype)
    return qn


# ---- spec: inputs, roofline and tolerance for the harness ------------------------------------------


def _inputs(wl, device, seed):
    c, r = wl.config, Rand("qk_prep", wl, device, seed)
    cache, meta = paged_kv(wl, r)
    n = wl.tokens
    w = {"q_norm": r.norm(c.head_dim), "k_norm": r.norm(c.head_dim)}
    kw = dict(cache=cache, slot_mapping=meta.slot_mapping, positions=meta.positions, eps=c.rms_norm_eps,
              **layer_kwargs(wl))
    return Call((r.normal(n, c.q_width), r.normal(n, c.kv_width), r.normal(n, c.kv_width), w), kw, weights_arg=3)


def _bytes(wl):
    c, n = wl.config, wl.tokens  # q, k, v in; q out; K, V to their slots; norms; slots and positions
    return DTYPE_BYTES[wl.dtype] * (n * (2 * c.q_width + 4 * c.kv_width) + 2 * c.head_dim) + 16 * n


declare(PointSpec(
    "qk_prep", _inputs, bytes=_bytes,
    flops=lambda wl: 10 * wl.tokens * (wl.config.q_width + wl.config.kv_width),  # norms, RoPE or SSMax
    tolerance={"fp32": 1e-5, "fp16": 1e-3, "bf16": 8e-3},  # ~2.5x the reference's worst vs FP64
    inplace=("cache",),
))
