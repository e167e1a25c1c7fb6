"""A quantized model's parameters: each quantized projection stored as its checkpoint stores it.

A projection `owner.<attr>` ([out, in], or the experts' [E, out, in] stack) becomes the format's tensors,
named so that the model's tensor names are the checkpoint's (`weights.checkpoint_tensors` splits the
experts' stacks): FP8 `<attr>` (E4M3) and `<attr>_scale`; NVFP4 `<attr>` (two E2M1 codes a byte),
`<attr>_scale` (E4M3), `<attr>_scale_2` and the input scale the format ships (read by no Hopper kernel).
For a Linear's `weight` the names are ModelOpt's: `weight`, `weight_scale`, `weight_scale_2`, `input_scale`.
`stored(owner, attr)` is what the fusion points receive: the tensor, or a `tensors.QuantizedWeight`.
"""

from __future__ import annotations

import torch
from torch import nn

from beam_model.quant.formats import NVFP4_BLOCK
from beam_model.quant.tensors import Fp8Weight, Nvfp4Weight

_FORMATS_ATTR = "_stored_formats"  # owner attribute: {attr: format} of its quantized projections


def scale_names(attr: str, fmt: str) -> dict[str, str]:
    """Role -> parameter name of a quantized projection's tensors besides `attr` itself."""
    names = {"scale": f"{attr}_scale"}
    if fmt == "nvfp4":
        names["scale_2"] = f"{attr}_scale_2"
        names["input_scale"] = "input_scale" if attr == "weight" else f"{attr}_input_scale"
    return names


def _shapes(shape: tuple[int, ...], fmt: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Role -> (shape, dtype) of a [..., out, in] projection's tensors in `fmt`."""
    *lead, rows, cols = shape
    if fmt == "fp8":
        return {"weight": ((*lead, rows, cols), torch.float8_e4m3fn), "scale": ((*lead, rows, 1), torch.float32)}
    if cols % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs a projection's input size to be a multiple of {NVFP4_BLOCK}, got {cols}")
    return {"weight": ((*lead, rows, cols // 2), torch.uint8),
            "scale": ((*lead, rows, cols // NVFP4_BLOCK), torch.float8_e4m3fn),
            "scale_2": (tuple(lead), torch.float32), "input_scale": (tuple(lead), torch.float32)}


def quantize_layout(owner: nn.Module, attr: str, fmt: str) -> None:
    """Replace the meta parameter `owner.<attr>` by the meta tensors of its `fmt` form."""
    shape = tuple(getattr(owner, attr).shape)
    roles = _shapes(shape, fmt)
    names = {"weight": attr, **scale_names(attr, fmt)}
    for role, (s, dtype) in roles.items():
        setattr(owner, names[role], nn.Parameter(torch.empty(s, device="meta", dtype=dtype), requires_grad=False))
    owner.__dict__.setdefault(_FORMATS_ATTR, {})[attr] = fmt


def quantized_parameters(model: nn.Module) -> tuple[dict[str, tuple[nn.Module, str, str]], set[str]]:
    """{name of a quantized projection's codes: (owner, attr, format)}, and the names of their scales."""
    projections, scales = {}, set()
    for prefix, owner in model.named_modules():
        for attr, fmt in owner.__dict__.get(_FORMATS_ATTR, {}).items():
            dot = f"{prefix}." if prefix else ""
            projections[dot + attr] = (owner, attr, fmt)
            scales |= {dot + n for n in scale_names(attr, fmt).values()}
    return projections, scales


def stored_format(owner: nn.Module, attr: str) -> str | None:
    """The format `owner.<attr>` is stored in, or None for the model dtype."""
    return owner.__dict__.get(_FORMATS_ATTR, {}).get(attr)


def logical_shape(owner: nn.Module, attr: str) -> tuple[int, ...]:
    """The [..., out, in] shape of a projection, whatever its stored format."""
    t = getattr(owner, attr)
    return (*t.shape[:-1], 2 * t.shape[-1]) if stored_format(owner, attr) == "nvfp4" else tuple(t.shape)


def stored(owner: nn.Module, attr: str):
    """`owner.<attr>` as the fusion points read it: the tensor, or its quantized weight."""
    fmt = stored_format(owner, attr)
    if fmt is None:
        return getattr(owner, attr)
    names = scale_names(attr, fmt)
    if fmt == "fp8":
        return Fp8Weight(getattr(owner, attr), getattr(owner, names["scale"]))
    return Nvfp4Weight(getattr(owner, attr), getattr(owner, names["scale"]), getattr(owner, names["scale_2"]))


def stored_parts(attr: str, value) -> dict[str, torch.Tensor]:
    """A QuantizedWeight's tensors under the names a projection stored as `attr` gives them (a checkpoint's
    module has attr "weight": `weight`, `weight_scale`, ...)."""
    names = scale_names(attr, value.format)
    parts = {attr: value.weight, names["scale"]: value.scale}
    if value.format == "nvfp4":
        parts[names["scale_2"]] = value.scale_2
        # Read only by kernels that quantize activations to FP4 (none on Hopper); uncalibrated.
        parts[names["input_scale"]] = torch.ones_like(value.scale_2)
    return parts


def assign(owner: nn.Module, attr: str, value) -> None:
    """Set a projection's stored tensors from a tensor (model dtype) or a QuantizedWeight of its format."""
    parts = {attr: value} if stored_format(owner, attr) is None else stored_parts(attr, value)
    for name, t in parts.items():
        setattr(owner, name, nn.Parameter(t, requires_grad=False))
