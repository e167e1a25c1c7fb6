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
from workbench.registry import register


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
