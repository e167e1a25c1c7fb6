"""Arguments and helpers shared by several CLI commands."""

from __future__ import annotations

import json

import torch

from workbench.dtypes import DTYPES, dtype_of


def add_model_arguments(p, *, default_preset: str = "beam-tiny", default_dtype: str | None = None) -> None:
    p.add_argument("--preset", default=default_preset, help="model preset (default: %(default)s)")
    p.add_argument("--model", metavar="DIR", help="load a checkpoint folder instead of a preset")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=default_dtype,
                   help="model dtype (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights of a preset")


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but no CUDA GPU is visible")
    return device


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return dtype_of(name)


def load_model(args, variants: dict | None = None):
    from beam_model import BeamForCausalLM

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.model:
        return BeamForCausalLM.from_pretrained(args.model, dtype=dtype, device=device, variants=variants)
    return BeamForCausalLM.from_preset(args.preset, seed=args.seed, dtype=dtype, device=device, variants=variants)


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))
