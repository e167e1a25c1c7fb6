"""Quantized checkpoints on disk: written from a BF16 one (`quantize_checkpoint`), checked and read back
dequantized (`load_dequantized`: the reference's weight-only semantics, every weight in the model dtype).

A quantized checkpoint is a BF16 checkpoint folder whose config.json also carries `quantization_config`
and whose quantized projections are stored as the format says, scales beside them (`scheme.py`,
`formats.py`). Before any data is read, every tensor's name, shape and dtype is checked against what the
config and the scheme call for; a CheckpointError names every missing, unexpected, mis-shaped or
mis-typed tensor. Tensors are converted one at a time, so a checkpoint larger than memory converts.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch
from safetensors import safe_open

from beam_model.config import BeamConfig
from beam_model.quant import formats
from beam_model.quant.scheme import FP8, QuantScheme
from beam_model.tokenizer import copy_tokenizer_files
from beam_model.weights import (
    MAX_SHARD_BYTES,
    CheckpointError,
    ShardWriter,
    _checkpoint_files,
    _target,
    name_problems,
    tensor_layout,
)

CONFIG = "config.json"
_SAFETENSORS_DTYPES = {torch.float8_e4m3fn: "F8_E4M3", torch.uint8: "U8", torch.float32: "F32",
                       torch.bfloat16: "BF16", torch.float16: "F16"}


def read_config(path: str) -> tuple[BeamConfig, QuantScheme | None]:
    """The model config of a checkpoint folder and its quantization scheme (None: not quantized)."""
    file = os.path.join(path, CONFIG)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no {CONFIG} in {path}")
    with open(file) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file} is not valid JSON: {e}") from None
    quant = d.pop("quantization_config", None)
    return BeamConfig.from_dict(d), None if quant is None else QuantScheme.from_config(quant)


def bf16_layout(config: BeamConfig) -> tuple[dict, dict]:
    """(name -> shape, name -> dtype) of the config's BF16 checkpoint (router FP32), from a meta model."""
    from beam_model.model import BeamForCausalLM
    from beam_model.weights import checkpoint_tensors

    tensors = checkpoint_tensors(BeamForCausalLM(config, torch.bfloat16))
    return {n: tuple(t.shape) for n, t in tensors.items()}, {n: t.dtype for n, t in tensors.items()}


def checked_quantized_files(path: str, scheme: QuantScheme, shapes: dict, dtypes: dict) -> dict[str, str]:
    """Tensor name -> file, once every name, shape and dtype is what `scheme` calls for, given the BF16
    checkpoint's `shapes` and `dtypes` (`bf16_layout`)."""
    expected = scheme.expected(shapes, dtypes)
    files = _checkpoint_files(path)
    found = tensor_layout(files)
    problems = name_problems(expected, found)
    for name, (shape, dtype) in expected.items():
        if name not in found:
            continue
        got_shape, got_dtype = found[name]
        if got_shape != shape:
            problems.append(f"tensor {name} has shape {list(got_shape)}, expected {list(shape)}")
        if got_dtype != _SAFETENSORS_DTYPES[dtype]:
            problems.append(f"tensor {name} is {got_dtype}, expected {_SAFETENSORS_DTYPES[dtype]}")
    if problems:
        raise CheckpointError(f"{scheme.format} checkpoint {path} does not match its config: " + "; ".join(problems))
    return files


def dequantized(module: str, scheme: QuantScheme, get) -> torch.Tensor:
    """A quantized module's weight in FP32; `get(name)` reads a tensor of the checkpoint."""
    if scheme.algo == FP8:
        return formats.dequantize_fp8(get(f"{module}.weight"), get(f"{module}.weight_scale"))
    return formats.dequantize_nvfp4(get(f"{module}.weight"), get(f"{module}.weight_scale"),
                                    get(f"{module}.weight_scale_2"))


@torch.no_grad()
def load_dequantized(path: str, *, dtype=torch.bfloat16, device=None, variants=None):
    """A BeamForCausalLM from a quantized checkpoint, every quantized weight dequantized into `dtype`."""
    from beam_model.model import BeamForCausalLM
    from beam_model.weights import materialize

    config, scheme = read_config(path)
    if scheme is None:
        return BeamForCausalLM.from_pretrained(path, dtype=dtype, device=device, variants=variants)
    device = torch.device(device) if device is not None else torch.device("cpu")
    shapes, dtypes = bf16_layout(config)
    files = checked_quantized_files(path, scheme, shapes, dtypes)
    model = BeamForCausalLM(config, dtype)
    params = materialize(model, device)
    with contextlib.ExitStack() as opened:
        handles = {file: opened.enter_context(safe_open(file, framework="pt", device=str(device)))
                   for file in set(files.values())}

        def get(name):
            return handles[files[name]].get_tensor(name)

        for name in shapes:  # the model's tensors; scales are read with their weights
            module = name.removesuffix(".weight")
            quantized = name.endswith(".weight") and scheme.quantizes(module)
            _target(params, name).copy_(dequantized(module, scheme, get) if quantized else get(name))
    model.set_variants(variants)
    return model


@torch.no_grad()
def quantize_checkpoint(src: str, dst: str, fmt: str, *, max_shard_bytes: int = MAX_SHARD_BYTES) -> QuantScheme:
    """Write `src` (a BF16 checkpoint folder) to `dst` in `fmt` ("fp8" or "nvfp4"), tokenizer files copied."""
    from beam_model.weights import checked_files

    config, existing = read_config(src)
    if existing is not None:
        raise ValueError(f"{src} is already quantized ({existing.algo}); quantize its BF16 source")
    scheme = QuantScheme.for_format(fmt)
    shapes, _ = bf16_layout(config)
    files = checked_files(src, shapes)
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError("the destination must be another folder than the source")
    os.makedirs(dst, exist_ok=True)
    writer = ShardWriter(dst, max_shard_bytes)
    for file in sorted(set(files.values())):
        with safe_open(file, framework="pt") as f:
            for name in [n for n in f.keys() if files.get(n) == file]:
                t, module = f.get_tensor(name), name.removesuffix(".weight")
                if not (name.endswith(".weight") and scheme.quantizes(module)):
                    writer.add(name, t)
                elif scheme.algo == FP8:
                    weight, scale = formats.quantize_fp8(t)
                    writer.add(name, weight)
                    writer.add(f"{module}.weight_scale", scale)
                else:
                    weight, scale, scale_2 = formats.quantize_nvfp4(t)
                    writer.add(name, weight)
                    writer.add(f"{module}.weight_scale", scale)
                    writer.add(f"{module}.weight_scale_2", scale_2)
                    # Read only by kernels that quantize activations to FP4 (none on Hopper); uncalibrated.
                    writer.add(f"{module}.input_scale", torch.tensor(1.0))
    writer.close()
    with open(os.path.join(dst, CONFIG), "w") as f:
        json.dump({**config.to_dict(), "quantization_config": scheme.to_config()}, f, indent=2)
        f.write("\n")
    copy_tokenizer_files(src, dst)
    return scheme
