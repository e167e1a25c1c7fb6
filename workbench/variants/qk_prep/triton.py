"""`qk_prep:triton`: Q/K head norms, RoPE / SSMax and the KV-cache write in one Triton kernel, one
program per token with all its heads, so the token's cos/sin (or SSMax factor) is computed once.

Kernels are defined only when triton imports; the variant is registered either way and the registry
reports the backend as unavailable.
"""

import functools

import numpy as np
import torch

from workbench.registry import register
from workbench.variants.kernels.triton_common import pdl_launch, pow2, triton

if triton is not None:
    import triton.language as tl

    from workbench.variants.kernels.triton_common import pdl_enter, round_to

    @triton.jit
    def _norm_weight(w_ptr, HD: tl.constexpr, HALF: tl.constexpr):
        """A head norm's weight as its rotate-half halves [1, HALF] in FP32 (masked lanes hold 0)."""
        half = HD // 2
        d = tl.arange(0, HALF)[None, :]
        w1 = tl.load(w_ptr + d, mask=d < half, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + half + d, mask=d < half, other=0.0).to(tl.float32)
        return w1, w2

    @triton.jit
    def _head_rms_norm(x_ptr, row_stride, w_ptr, w1, w2, row, n_heads, eps,
                       HD: tl.constexpr, HEADS: tl.constexpr, HALF: tl.constexpr, LOADED: tl.constexpr):
        """RMSNorm over each head of one token, rounded to the model dtype like the reference. The
        weight halves are `w1`, `w2` (from `_norm_weight`) if LOADED, else read here from `w_ptr`,
        after the token's row: loaded before it, they cost registers and spills at 1-2 warps
        (compiled for sm_90, docs/decisions.md #26).

        Returns the rotate-half halves [HEADS, HALF] in FP32 (masked lanes hold 0), so RoPE can pair
        element d with d + hd/2 without a shuffle."""
        half = HD // 2
        h = tl.arange(0, HEADS)[:, None]
        d = tl.arange(0, HALF)[None, :]
        mask = (h < n_heads) & (d < half)
        ptr = x_ptr + row * row_stride + h * HD + d
        x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptr + half, mask=mask, other=0.0).to(tl.float32)
        r = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HD + eps)[:, None]
        if not LOADED:
            w1, w2 = _norm_weight(w_ptr, HD, HALF)
        dt = x_ptr.dtype.element_ty
        return round_to(x1 * r * w1, dt).to(tl.float32), round_to(x2 * r * w2, dt).to(tl.float32)

    @triton.jit
    def _rotation(pos, theta, ssmax_base, ssmax_exponent, HD: tl.constexpr, HALF: tl.constexpr,
                  ROPE: tl.constexpr, SSMAX: tl.constexpr):
        """(cos, sin) [1, HALF] of RoPE at `pos`, or SSMax's factor (as cos, sin 0), in FP32.

        Angles are FP64 as in the reference: at positions near 1M an FP32 angle is off by up to ~0.03
        rad, while FP64 keeps the error ~1e-9 rad, below FP32 resolution of cos/sin. inv_freq is
        theta^(-2i/hd) = exp(-(2i/hd) ln theta) in FP64 (within ~1e-15 of the reference's pow). The
        angle is reduced to [-pi, pi] in FP64 (error ~1e-10 rad at 1M positions) and only then rounded
        to FP32, so FP32 cos/sin (a few ulp) replace FP64 ones, which cost a one-program decode launch
        more than the rest of its arithmetic."""
        cos, sin = 1.0, 0.0
        if ROPE:
            i = tl.arange(0, HALF).to(tl.float64)
            inv_freq = tl.exp(-(i * 2.0 / HD) * tl.log(tl.cast(theta, tl.float64)))
            angle = pos.to(tl.float64) * inv_freq
            turns = tl.floor(angle * 0.15915494309189535 + 0.5)  # 1 / (2 pi)
            # 2 pi as the FP64 value nearest to it plus the remainder, so the reduction keeps ~1e-16 rad
            r = ((angle - turns * 6.283185307179586) - turns * 2.4492935982947064e-16).to(tl.float32)
            cos, sin = tl.cos(r)[None, :], tl.sin(r)[None, :]
        if SSMAX:  # (1 + p/base)^exponent, p 1-based; the base in FP32 as the reference, pow via FP64
            x = 1.0 + (pos.to(tl.float32) + 1.0) / ssmax_base
            cos = tl.exp(tl.cast(ssmax_exponent, tl.float64) * tl.log(x.to(tl.float64))).to(tl.float32)
        return cos, sin

    @triton.jit
    def _qk_prep_kernel(q_ptr, k_ptr, v_ptr, q_w_ptr, k_w_ptr, cache_ptr, slot_ptr, pos_ptr, q_out_ptr,
                        q_stride, k_stride, v_stride, n_heads, n_kv_heads, page_size,
                        c_page, c_kv, c_slot, c_head, eps, theta, ssmax_base, ssmax_exponent,
                        HD: tl.constexpr, HALF: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                        ROPE: tl.constexpr, SSMAX: tl.constexpr, PDL: tl.constexpr = False):
        """Q/K head norms -> round -> RoPE or SSMax -> round, K and V into the paged cache: one token
        per program, all its heads at once so the token's cos/sin (or SSMax factor) is computed once
        (`_rotation`)."""
        t = tl.program_id(0).to(tl.int64)
        half = HD // 2
        # The norm weights and the positions are the step's inputs, never written by a kernel of it:
        # with PDL they are read, and the rotation computed, while the previous kernel finishes.
        qw1, qw2, kw1, kw2 = 0.0, 0.0, 0.0, 0.0
        if PDL:
            qw1, qw2 = _norm_weight(q_w_ptr, HD, HALF)
            kw1, kw2 = _norm_weight(k_w_ptr, HD, HALF)
            cos, sin = _rotation(tl.load(pos_ptr + t), theta, ssmax_base, ssmax_exponent, HD, HALF, ROPE, SSMAX)
        pdl_enter(PDL)
        q1, q2 = _head_rms_norm(q_ptr, q_stride, q_w_ptr, qw1, qw2, t, n_heads, eps, HD, HEADS, HALF, PDL)
        k1, k2 = _head_rms_norm(k_ptr, k_stride, k_w_ptr, kw1, kw2, t, n_kv_heads, eps, HD, KV_HEADS, HALF, PDL)
        if not PDL:
            cos, sin = _rotation(tl.load(pos_ptr + t), theta, ssmax_base, ssmax_exponent, HD, HALF, ROPE, SSMAX)
        if ROPE:
            q1, q2 = q1 * cos - q2 * sin, q2 * cos + q1 * sin
            k1, k2 = k1 * cos - k2 * sin, k2 * cos + k1 * sin
        if SSMAX:
            q1, q2 = q1 * cos, q2 * cos
        dt = q_out_ptr.dtype.element_ty
        h = tl.arange(0, HEADS)[:, None]
        d = tl.arange(0, HALF)[None, :]
        q_mask = (h < n_heads) & (d < half)
        q_out = q_out_ptr + t * (n_heads * HD) + h * HD + d
        tl.store(q_out, round_to(q1, dt), mask=q_mask)
        tl.store(q_out + half, round_to(q2, dt), mask=q_mask)
        # The cache write: slot -> (page, offset); K rounded to the model dtype first, then the cache's.
        slot = tl.load(slot_ptr + t).to(tl.int64)
        kv = tl.arange(0, KV_HEADS)[:, None]
        k_mask = (kv < n_kv_heads) & (d < half)
        kv_slot = cache_ptr + (slot // page_size) * c_page + (slot % page_size) * c_slot + kv * c_head
        cdt = cache_ptr.dtype.element_ty
        tl.store(kv_slot + d, round_to(k1, dt).to(cdt), mask=k_mask)
        tl.store(kv_slot + half + d, round_to(k2, dt).to(cdt), mask=k_mask)
        vd = tl.arange(0, 2 * HALF)[None, :]
        v_mask = (kv < n_kv_heads) & (vd < HD)
        v = tl.load(v_ptr + t * v_stride + kv * HD + vd, mask=v_mask)
        tl.store(kv_slot + c_kv + vd, v.to(cdt), mask=v_mask)


MAX_TILE = 8192  # q heads x head_dim of one token, padded to powers of two, in one program
CONFIGS = [{"num_warps": 4}, {"num_warps": 1}, {"num_warps": 2}, {"num_warps": 8}]


def _fp32_exact(x) -> bool:
    return float(np.float32(x)) == float(x)


def _qk_prep_triton_at(q, k, v, w, *, cache, slot_mapping, positions, eps, rope_theta=None, ssmax=None,
                       num_warps=4, pdl=False):
    n, hd = q.shape[0], cache.shape[-1]
    heads, kv_heads = q.shape[1] // hd, cache.shape[3]
    if rope_theta is not None and not _fp32_exact(rope_theta):
        raise ValueError(f"qk_prep:triton passes rope_theta as FP32; {rope_theta} is not exact in FP32")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    slot_mapping, positions = slot_mapping.contiguous(), positions.contiguous()  # no-ops when contiguous
    q_out = torch.empty((n, heads, hd), dtype=q.dtype, device=q.device)
    if n:
        base, exponent = ssmax if ssmax is not None else (1.0, 1.0)
        c = cache.stride()
        _qk_prep_kernel[(n,)](
            q, k, v, w["q_norm"], w["k_norm"], cache, slot_mapping, positions, q_out,
            q.stride(0), k.stride(0), v.stride(0), heads, kv_heads, cache.shape[2],
            c[0], c[1], c[2], c[3], eps, float(rope_theta or 1.0), float(base), float(exponent),
            HD=hd, HALF=pow2(hd // 2), HEADS=pow2(heads), KV_HEADS=pow2(kv_heads),
            ROPE=rope_theta is not None, SSMAX=ssmax is not None, num_warps=num_warps, **pdl_launch(pdl))
    return q_out


def _supports(workload):
    c = workload.config
    if workload.dtype not in ("bf16", "fp16", "fp32"):
        return f"dtype {workload.dtype} not handled (bf16, fp16, fp32)"
    tile = pow2(c.num_attention_heads) * pow2(c.head_dim)
    if tile > MAX_TILE:
        return f"{c.num_attention_heads} heads x hd {c.head_dim} exceed one program's tile ({MAX_TILE})"
    if workload.layer == "sliding" and not _fp32_exact(c.rope_theta):
        return f"rope_theta {c.rope_theta} is not exact in FP32 (the kernel takes it as an FP32 argument)"
    return True


@register("qk_prep", "triton", "triton", supports=_supports, configs=CONFIGS, pdl=True,
          configure=lambda cfg: functools.partial(_qk_prep_triton_at, **cfg))
def qk_prep_triton(q, k, v, w, *, cache, slot_mapping, positions, eps, rope_theta=None, ssmax=None):
    """One Triton kernel per call: norms, RoPE / SSMax, q_out and the K/V cache write."""
    return _qk_prep_triton_at(q, k, v, w, cache=cache, slot_mapping=slot_mapping, positions=positions, eps=eps,
                              rope_theta=rope_theta, ssmax=ssmax, **CONFIGS[0])
