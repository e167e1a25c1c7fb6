"""What `workbench train` builds: the configs it trains (beam-mini, and beam-tiny for tests) and their
initial weights.

beam-mini keeps every structural feature of Beam at a size that trains in minutes on one GPU and whose
BF16 safetensors stay small enough to commit: 8 layers (sliding-window RoPE layers, full SSMax layers
at 5 and 7 as Beam's pattern puts them), one dense layer then MoE layers of 16 experts in 4 groups
(top-2 groups, 4 experts per token, the correction bias), gates, sandwich norms, depth-scaled residuals,
the soft-capped head. The vocabulary is the tokenizer's.

Initial weights: linear layers N(0, 1/fan_in) (unit-variance outputs), norms 1, embeddings N(0, 1), the
head N(0, 1/hidden) so the first logits are O(1) (a loss near ln(vocab)), gate and correction biases 0.
Every tensor FP32 and trainable except the correction bias, which the balancing rule moves.
"""

from __future__ import annotations

import math

import torch

from beam_model.config import PRESETS, BeamConfig
from beam_model.weights import _set_param

# The presets it trains (beam_model/config.py), less their vocabulary: the tokenizer's
CONFIGS: dict[str, dict] = {name: {k: v for k, v in PRESETS[name].items() if k != "vocab_size"}
                            for name in ("beam-mini", "beam-tiny")}


def training_config(name: str, vocab_size: int) -> BeamConfig:
    if name not in CONFIGS:
        raise KeyError(f"unknown training config {name!r}; known: {', '.join(CONFIGS)}")
    return BeamConfig(**CONFIGS[name], vocab_size=vocab_size, preset=name)


# Embedding vectors (the model's, and a drafter's mask): N(0, 1), and no weight decay
EMBEDDINGS = ("model.embed_tokens.weight", "mask_embedding")


def _std(name: str, shape: tuple[int, ...]) -> float | None:
    """The initial std of a parameter; None: a constant (1 for norms, 0 for biases)."""
    if name.endswith("norm.weight") or name.endswith("gate_bias") or name.endswith("e_score_correction_bias"):
        return None
    if name in EMBEDDINGS:
        return 1.0
    return 1.0 / math.sqrt(shape[-1])


def initial_value(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """A parameter's initial FP32 value on the CPU by the rules above (random ones drawn from `generator`)."""
    std = _std(name, shape)
    if std is None:
        return torch.full(shape, 1.0 if name.endswith("norm.weight") else 0.0)
    return torch.randn(shape, generator=generator) * std


def initial_model(config: BeamConfig, *, seed: int, device) -> torch.nn.Module:
    """An FP32 model with the initial weights above, on `device`."""
    from beam_model.model import BeamForCausalLM

    model = BeamForCausalLM(config, dtype=torch.float32)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in list(model.named_parameters()):
        _set_param(model, name, initial_value(name, tuple(p.shape), gen).to(device=device, dtype=torch.float32))
        model.get_parameter(name).requires_grad_(not name.endswith("e_score_correction_bias"))
    model.set_variants()
    return model


def to_bf16(model) -> torch.nn.Module:
    """A BF16 copy of a trained FP32 model for its checkpoint (the router stays FP32, as the model keeps it)."""
    from beam_model.model import BeamForCausalLM

    out = BeamForCausalLM(model.config, dtype=torch.bfloat16)
    dtypes = {name: p.dtype for name, p in out.named_parameters()}
    for name, p in model.named_parameters():
        _set_param(out, name, p.detach().to(dtypes[name]).clone())
    out.set_variants()
    return out
