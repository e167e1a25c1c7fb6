"""A quantized projection's weight as the model and the fusion points hold it: the stored tensors of its
format (`formats.py`, the checkpoint's own layout) with any leading dims (the experts' [E, out, in] stack).

`dense(w, dtype)` is how a reference reads a weight, quantized or not: the stored weight dequantized, then
the model dtype's math (weight-only semantics). Indexing the leading dims (`w[ids]`) selects experts
without dequantizing the others, so a reference that gathers the selected experts reads only theirs.
Both kinds are dataclasses of tensors, so the harness copies, clones and moves them as it does any input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Union

import torch

from beam_model.quant import formats


@dataclass
class Fp8Weight:
    """Per-output-channel FP8: W[..., o, i] = weight[..., o, i] * scale[..., o, 0]."""

    weight: torch.Tensor  # float8_e4m3fn [..., out, in]
    scale: torch.Tensor   # float32 [..., out, 1]
    format: ClassVar[str] = "fp8"

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def __getitem__(self, index) -> "Fp8Weight":
        return Fp8Weight(self.weight[index], self.scale[index])

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        math = _math_dtype(dtype)
        return (self.weight.to(math) * self.scale.to(math)).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes


@dataclass
class Nvfp4Weight:
    """NVFP4 in blocks of 16 inputs: W[..., o, i] = e2m1(code[..., o, i]) * scale[..., o, i // 16] * scale_2[...],
    two codes a byte, the even input in the low nibble."""

    weight: torch.Tensor   # uint8 [..., out, in / 2]
    scale: torch.Tensor    # float8_e4m3fn [..., out, in / 16]
    scale_2: torch.Tensor  # float32 [...]: one per projection (per expert in a stack)
    format: ClassVar[str] = "nvfp4"

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.weight.shape[:-1], 2 * self.weight.shape[-1]))

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def __getitem__(self, index) -> "Nvfp4Weight":
        return Nvfp4Weight(self.weight[index], self.scale[index], self.scale_2[index])

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        math = _math_dtype(dtype)
        codes = torch.stack((self.weight & 0x0F, self.weight >> 4), dim=-1).flatten(-2)
        values = formats.e2m1_values(codes).to(math)
        scales = self.scale.to(math).repeat_interleave(formats.NVFP4_BLOCK, dim=-1)
        return (values * scales * self.scale_2.to(math)[..., None, None]).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes + self.scale_2.nbytes


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    """FP32, or FP64 for a float64 result (the gates' exact reference): the stored values and scales are
    exact in either, so the product rounds once, into the result."""
    return torch.float64 if dtype == torch.float64 else torch.float32


QuantizedWeight = Union[Fp8Weight, Nvfp4Weight]
KINDS = {"fp8": Fp8Weight, "nvfp4": Nvfp4Weight}
WEIGHT_FORMATS = ("bf16", *KINDS)  # "bf16": the model dtype's own weights, whatever that dtype is


def is_quantized(w) -> bool:
    return isinstance(w, (Fp8Weight, Nvfp4Weight))


def dense(w, dtype: torch.dtype) -> torch.Tensor:
    """A weight as the math reads it: a tensor as it is, a quantized weight dequantized into `dtype`."""
    return w.dequantize(dtype) if is_quantized(w) else w


def weight_format(w) -> str:
    return w.format if is_quantized(w) else "bf16"


@torch.no_grad()
def quantize(w: torch.Tensor, fmt: str) -> QuantizedWeight:
    """[..., out, in] -> its `fmt` form, each [out, in] matrix as `workbench quantize` writes it (NVFP4: one
    global scale a matrix)."""
    if fmt not in KINDS:
        raise ValueError(f"unknown weight format {fmt!r}; quantized formats: {', '.join(KINDS)}")
    lead, (rows, cols) = w.shape[:-2], w.shape[-2:]
    if fmt == "fp8":
        weight, scale = formats.quantize_fp8(w.reshape(-1, cols))
        return Fp8Weight(weight.view(*lead, rows, cols), scale.view(*lead, rows, 1))
    parts = [formats.quantize_nvfp4(m) for m in w.reshape(-1, rows, cols)]
    weight, scale, scale_2 = (torch.stack([p[i] for p in parts]) for i in range(3))
    return Nvfp4Weight(weight.view(*lead, rows, cols // 2), scale.view(*lead, rows, cols // formats.NVFP4_BLOCK),
                       scale_2.view(lead))
