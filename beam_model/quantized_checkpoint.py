"""A BF16 checkpoint written in FP8 or NVFP4 (`quantize_checkpoint`, behind `workbench quantize`).

A quantized checkpoint is a BF16 checkpoint folder whose config.json also carries `quantization_config`
and whose quantized projections are stored as the format says, scales beside them (`quant/scheme.py`,
`quant/formats.py`); a quantized model reads one as it reads a BF16 one (`weights.load_checkpoint`).
Tensors are converted one at a time, so a checkpoint larger than memory converts.
"""

from __future__ import annotations

import os

import torch
from safetensors import safe_open

from beam_model.config import BeamConfig
from beam_model.quant.layout import stored_parts
from beam_model.quant.scheme import QuantScheme, read_config
from beam_model.quant.tensors import quantize
from beam_model.tokenizer import copy_tokenizer_files
from beam_model.weights import MAX_SHARD_BYTES, ShardWriter, checked_files, checkpoint_tensors


def bf16_layout(config: BeamConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the config's BF16 checkpoint, from a meta model."""
    from beam_model.model import BeamForCausalLM

    return {n: tuple(t.shape) for n, t in checkpoint_tensors(BeamForCausalLM(config, torch.bfloat16)).items()}


@torch.no_grad()
def quantize_checkpoint(src: str, dst: str, fmt: str, *, max_shard_bytes: int = MAX_SHARD_BYTES) -> QuantScheme:
    """Write `src` (a BF16 checkpoint folder) to `dst` in `fmt` ("fp8" or "nvfp4"), tokenizer files copied."""
    config, existing = read_config(src)
    if existing is not None:
        raise ValueError(f"{src} is already quantized ({existing.algo}); quantize its BF16 source")
    scheme = QuantScheme.for_format(fmt)
    files = checked_files(src, bf16_layout(config))
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
                    continue
                for part, stored in stored_parts("weight", quantize(t, scheme.format)).items():
                    writer.add(f"{module}.{part}", stored)
    writer.close()
    config.save_pretrained(dst, scheme.to_config())
    copy_tokenizer_files(src, dst)
    return scheme
