"""The DFlash drafter's configuration: its config.json fields and the target layers it reads.

A drafter folder sits beside its target's: config.json (`model_type` "beam_dflash"), model.safetensors.
It names the target it was trained for by the target's `config_hash`, so a drafter is never paired
with another model by accident. Like `config.py`, this module must not import torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from beam_model.config import SLIDING, BeamConfig, read_config_json

MODEL_TYPE = "beam_dflash"
# The published drafter reads the outputs of these layers of Beam's 52 (beam-architecture.md, DFlash).
BEAM_TAPS = (1, 13, 25, 37, 49)
BEAM_LAYERS = 52


def proportional_taps(num_target_layers: int) -> list[int]:
    """The layers a drafter reads in a target of `num_target_layers`: Beam's five at the same relative
    depths (rounded, the last layer at most, repeats dropped): [0, 2, 4, 6, 7] for beam-mini's 8."""
    picked = [min(num_target_layers - 1, round(t * num_target_layers / BEAM_LAYERS)) for t in BEAM_TAPS]
    return sorted(set(picked))


@dataclass
class DrafterConfig:
    target_layer_ids: list[int]
    target_config_hash: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int = 5
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    sliding_window: int = 128          # how far back the drafter's context reaches (its layers' window)
    block_size: int = 16               # the last accepted token and block_size - 1 drafts
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float = 30.0
    model_type: str = MODEL_TYPE

    def __post_init__(self):
        problems = []
        if self.model_type != MODEL_TYPE:
            problems.append(f"model_type is {self.model_type!r}, expected {MODEL_TYPE!r}")
        if not self.target_layer_ids or list(self.target_layer_ids) != sorted(set(self.target_layer_ids)):
            problems.append(f"target_layer_ids must be distinct layer indices in increasing order (the order "
                            f"the target produces them), got {self.target_layer_ids}")
        if self.block_size < 2:
            problems.append("block_size must be at least 2 (the last token and one draft)")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            problems.append("head_dim must be even for rotate-half RoPE")
        if problems:
            raise ValueError("invalid drafter config: " + "; ".join(problems))

    @classmethod
    def for_target(cls, target: BeamConfig, **kw) -> "DrafterConfig":
        """A drafter at the target's hidden size, reading `proportional_taps` of its layers, with the
        target's attention shape, window, RoPE and soft-cap unless `kw` says otherwise."""
        base = dict(target_layer_ids=proportional_taps(target.num_hidden_layers),
                    target_config_hash=target.config_hash(), vocab_size=target.vocab_size,
                    hidden_size=target.hidden_size, num_attention_heads=target.num_attention_heads,
                    num_key_value_heads=target.num_key_value_heads, head_dim=target.head_dim,
                    intermediate_size=target.intermediate_size, sliding_window=target.sliding_window,
                    rope_theta=target.rope_theta, rms_norm_eps=target.rms_norm_eps,
                    final_logit_softcapping=target.final_logit_softcapping)
        return cls(**{**base, **kw})

    def check_target(self, target: BeamConfig) -> None:
        """ValueError unless this drafter was made for `target`."""
        if target.config_hash() != self.target_config_hash:
            raise ValueError(f"the drafter was trained for the target with config hash {self.target_config_hash}, "
                             f"not this one ({target.config_hash()})")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            raise ValueError(f"the drafter reads target layers {bad}, the target has {target.num_hidden_layers}")

    def layer_config(self) -> BeamConfig:
        """The draft layers' shapes as a Beam config (sliding-window layers with a dense MLP), so they
        are built from the target's modules and run through the same fusion points."""
        return BeamConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                          num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
                          num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                          sliding_window=self.sliding_window, layer_types=[SLIDING] * self.num_hidden_layers,
                          first_k_dense_replace=self.num_hidden_layers, intermediate_size=self.intermediate_size,
                          rope_theta=self.rope_theta, rms_norm_eps=self.rms_norm_eps,
                          final_logit_softcapping=self.final_logit_softcapping)

    @property
    def feature_width(self) -> int:
        """The width of the target features it reads: the tapped layers' outputs, concatenated."""
        return len(self.target_layer_ids) * self.hidden_size

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save_pretrained(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @classmethod
    def from_pretrained(cls, path: str) -> "DrafterConfig":
        d = read_config_json(path)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{path}/config.json has unknown drafter fields {unknown}")
        if d.get("model_type") != MODEL_TYPE:
            raise ValueError(f"{path} is not a DFlash drafter (model_type {d.get('model_type')!r}, "
                             f"expected {MODEL_TYPE!r})")
        try:
            return cls(**d)
        except TypeError as e:
            raise ValueError(f"{path}/config.json: {e}") from None
