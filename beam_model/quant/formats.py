"""The two weight formats, tensor by tensor (`beam-architecture.md`, Quantized checkpoints).

FP8 (per output channel): `weight` float8_e4m3fn [out, in], `weight_scale` float32 [out, 1] = the row's
amax / 448; W = weight * weight_scale.

NVFP4 (blocks of 16 inputs): `weight` uint8 [out, in / 2], two E2M1 codes per byte, the even input in
the low nibble (bit 3 the sign, bits 0-2 index E2M1_VALUES); `weight_scale` float8_e4m3fn [out, in / 16];
`weight_scale_2` float32 scalar = amax(W) / (448 * 6); W[o, i] = e2m1(code[o, i]) * weight_scale[o, i // 16]
* weight_scale_2.

Rounding is to nearest, ties to even (the code whose last bit is 0), values past the largest magnitude
saturate to it (448 for E4M3, 6 for E2M1). All-zero rows and blocks get scale 1 and 0 respectively, so
no division by zero is ever taken.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NVFP4_BLOCK = 16


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """FP32 -> float8_e4m3fn, saturating (a plain cast makes NaN of what exceeds 448 on some versions)."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


# ---- FP8 per output channel -------------------------------------------------------------------------

def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (weight float8_e4m3fn [out, in], weight_scale float32 [out, 1])."""
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return to_e4m3(w / scale), scale


def dequantize_fp8(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    return weight.float() * weight_scale.float()


# ---- NVFP4 ------------------------------------------------------------------------------------------

def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """FP32 values (already divided by their scales) -> 4-bit codes (uint8), to nearest, ties to even."""
    grid = torch.tensor(E2M1_VALUES, device=x.device)
    mag = x.abs().clamp(max=E2M1_MAX)
    lo = (torch.bucketize(mag, grid, right=True) - 1).clamp(0, len(E2M1_VALUES) - 1)
    hi = (lo + 1).clamp(max=len(E2M1_VALUES) - 1)
    below, above = mag - grid[lo], grid[hi] - mag
    up = (above < below) | ((above == below) & (hi % 2 == 0) & (hi != lo))
    code = torch.where(up, hi, lo)
    sign = ((x < 0) & (code > 0)).to(torch.int64) << 3  # no negative zero
    return (code | sign).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes -> FP32 values (E2M1_VALUES), computed from the code's bits rather than looked up: a
    table would be copied from the host on every call, which a CUDA graph cannot capture."""
    c = codes.to(torch.int32)
    exponent, mantissa = (c >> 1) & 3, (c & 1).to(torch.float32)
    normal = torch.exp2((exponent - 1).to(torch.float32)) * (1 + 0.5 * mantissa)
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, normal)
    return torch.where(c & 8 > 0, -magnitude, magnitude)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[out, in] codes -> [out, in / 2] bytes, the even input in the low nibble."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[out, in / 2] bytes -> [out, in] codes."""
    out = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.uint8, device=packed.device)
    out[:, 0::2] = packed & 0x0F
    out[:, 1::2] = packed >> 4
    return out


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] (in a multiple of 16) -> (weight uint8 [out, in/2], weight_scale float8_e4m3fn
    [out, in/16], weight_scale_2 float32 [])."""
    w = w.float()
    out_f, in_f = w.shape
    if in_f % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs the input size to be a multiple of {NVFP4_BLOCK}, got {in_f}")
    amax = w.abs().amax()
    scale_2 = amax / (E4M3_MAX * E2M1_MAX) if amax > 0 else torch.tensor(1.0)
    blocks = w.view(out_f, in_f // NVFP4_BLOCK, NVFP4_BLOCK)
    block_scale = to_e4m3(blocks.abs().amax(-1) / (E2M1_MAX * scale_2))
    denominator = (block_scale.float() * scale_2).unsqueeze(-1)
    scaled = torch.where(denominator > 0, blocks / torch.where(denominator > 0, denominator, 1.0), 0.0)
    codes = e2m1_codes(scaled).view(out_f, in_f)
    return pack_nibbles(codes), block_scale, scale_2.float().reshape(())


def dequantize_nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    values = e2m1_values(unpack_nibbles(weight))
    scales = weight_scale.float().repeat_interleave(NVFP4_BLOCK, dim=1)
    return values * scales * weight_scale_2.float().reshape(())
