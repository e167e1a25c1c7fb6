"""Beam's elementary math in plain PyTorch: the building blocks of every reference variant.

Each function states its precision contract. They are the single definition of Beam's numerics
(RMSNorm flavour, RoPE convention, SSMax factor, depth-scaled residual, soft-cap); reference
variants in `workbench/variants/` compose them and the gates compare kernels against them.
"""

from __future__ import annotations

import math

import torch

from beam_model.quant.tensors import dense


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x * rsqrt(mean(x^2) + eps) * w` over the last dim, in FP32; returns FP32 (caller rounds)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def residual_coefficients(k: int) -> tuple[float, float]:
    """Coefficients (a, b) of the k-th depth-scaled residual add: h <- a*h + b*y.

    The embedding is term 1, so after add k the stream is the 1/sqrt(k+1)-scaled sum of k+1 terms.
    """
    if k < 1:
        raise ValueError(f"residual add index k starts at 1, got {k}")
    return math.sqrt(k / (k + 1)), 1.0 / math.sqrt(k + 1)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [N, head_dim/2] in FP32 for neox RoPE; angles in FP64 so 1M-token positions stay exact."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(half, device=positions.device, dtype=torch.float64) * 2 / head_dim))
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over all of head_dim. x [N, H, D] (FP32), cos/sin [N, D/2]; returns FP32."""
    x = x.float()
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def ssmax_scale(positions: torch.Tensor, base: float, exponent: float) -> torch.Tensor:
    """SSMax query factor (1 + p/base)^exponent, p the 1-based position; FP32 [N]."""
    p = positions.to(torch.float32) + 1.0
    return (1.0 + p / base).pow(exponent)


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """`cap * tanh(logits / cap)` in FP32."""
    return cap * torch.tanh(logits.float() / cap)


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x @ w.T in x's dtype; a quantized `w` (beam_model.quant.tensors) is dequantized into it first."""
    return torch.nn.functional.linear(x, dense(w, x.dtype))


def swiglu(x: torch.Tensor, gate_w, up_w, down_w) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)): GEMMs in x's dtype (quantized weights dequantized into it), the
    activation in FP32, rounded once."""
    g = linear(x, gate_w).float()
    u = linear(x, up_w).float()
    return linear((torch.nn.functional.silu(g) * u).to(x.dtype), down_w)
