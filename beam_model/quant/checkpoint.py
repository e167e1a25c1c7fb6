"""Quantized checkpoints on disk: written from a BF16 one (`quantize_checkpoint`), and checked before a
quantized model (`BeamForCausalLM.from_pretrained`) reads one (`checked_quantized_files`).

A quantized checkpoint is a BF16 checkpoint folder whose config.json also carries `quantization_config`
and whose quantized projections are stored as the format says, scales beside them (`scheme.py`,
`formats.py`). Before any data is read, every tensor's name, shape and dtype is checked against what the
config and the scheme call for; a CheckpointError names every missing, unexpected, mis-shaped or
mis-typed tensor. Tensors are converted one at a time, so a checkpoint larger than memory converts.
"""

from __future__ import annotations

import os

import torch
from safetensors import safe_open

from beam_model.config import QUANTIZATION_CONFIG, BeamConfig, read_config_json
from beam_model.quant import formats
from beam_model.quant.scheme import FP8, QuantScheme
from beam_model.tokenizer import copy_tokenizer_files
from beam_model.weights import (
    MAX_SHARD_BYTES,
    CheckpointError,
    ShardWriter,
    _checkpoint_files,
    name_problems,
    tensor_layout,
)

_SAFETENSORS_DTYPES = {torch.float8_e4m3fn: "F8_E4M3", torch.uint8: "U8", torch.float32: "F32",
                       torch.bfloat16: "BF16", torch.float16: "F16"}


def read_config(path: str) -> tuple[BeamConfig, QuantScheme | None]:
    """The model config of a checkpoint folder and its quantization scheme (None: not quantized)."""
    d = read_config_json(path)
    quant = d.pop(QUANTIZATION_CONFIG, None)
    return BeamConfig.from_dict(d), None if quant is None else QuantScheme.from_config(quant)


def bf16_layout(config: BeamConfig) -> tuple[dict, dict]:
    """(name -> shape, name -> dtype) of the config's BF16 checkpoint (router FP32), from a meta model."""
    from beam_model.model import BeamForCausalLM
    from beam_model.weights import checkpoint_tensors

    tensors = checkpoint_tensors(BeamForCausalLM(config, torch.bfloat16))
    return {n: tuple(t.shape) for n, t in tensors.items()}, {n: t.dtype for n, t in tensors.items()}


def checked_quantized_files(path: str, scheme: QuantScheme, config: BeamConfig) -> dict[str, str]:
    """Tensor name -> file, once every name, shape and dtype is what `scheme` calls for on `config`."""
    shapes, dtypes = bf16_layout(config)
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
    config.save_pretrained(dst, scheme.to_config())
    copy_tokenizer_files(src, dst)
    return scheme
