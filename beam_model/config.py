"""Beam model configuration: the config.json fields, named presets and derived facts.

Every field of the architecture doc's config.json is a dataclass field here with the same name,
so `save_pretrained` / `from_pretrained` are a plain JSON round trip. Derived facts (layer kinds,
parameter counts, KV bytes per token) are properties, never stored, so they cannot disagree with
the fields. This module must not import torch: the CLI reads configs on machines without a GPU
and before any heavy import.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field

ARCH_VERSION = 1
SLIDING = "sliding_attention"
FULL = "full_attention"


def default_layer_types(num_layers: int) -> list[str]:
    """Full attention on every sixth layer (5, 11, ...) and on the last layer; SWA elsewhere."""
    return [FULL if (i % 6 == 5 or i == num_layers - 1) else SLIDING for i in range(num_layers)]


@dataclass
class BeamConfig:
    vocab_size: int = 131072
    hidden_size: int = 5120
    num_hidden_layers: int = 52
    num_attention_heads: int = 48
    num_key_value_heads: int = 8
    head_dim: int = 128
    sliding_window: int = 512
    layer_types: list[str] = field(default_factory=list)
    rope_theta: float = 10000.0
    ssmax_base: float = 2048.0
    ssmax_exponent: float = 0.1
    first_k_dense_replace: int = 3
    intermediate_size: int = 20480
    moe_intermediate_size: int = 2560
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float = 30.0
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    model_type: str = "beam"
    arch_version: int = ARCH_VERSION
    # Not part of the published config: which preset this came from, for reports and lock files.
    preset: str | None = None

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = default_layer_types(self.num_hidden_layers)
        self.validate()

    def validate(self) -> None:
        problems = []
        if self.model_type != "beam":
            problems.append(f"model_type is {self.model_type!r}, expected 'beam'")
        if self.arch_version != ARCH_VERSION:
            problems.append(f"arch_version {self.arch_version} is not supported (this code: {ARCH_VERSION})")
        if len(self.layer_types) != self.num_hidden_layers:
            problems.append(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        bad = sorted({t for t in self.layer_types if t not in (SLIDING, FULL)})
        if bad:
            problems.append(f"unknown layer_types {bad}")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if self.n_routed_experts % self.n_group:
            problems.append("n_routed_experts must be a multiple of n_group")
        if not 0 < self.topk_group <= self.n_group:
            problems.append("topk_group must be in 1..n_group")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            problems.append("num_experts_per_tok exceeds the experts in the kept groups")
        if self.n_routed_experts // self.n_group < 2:
            problems.append("each expert group needs at least 2 experts (group score = top-2 sum)")
        if self.head_dim % 2:
            problems.append("head_dim must be even for rotate-half RoPE")
        if self.tie_word_embeddings:
            problems.append("tie_word_embeddings must be false for Beam")
        if problems:
            raise ValueError("invalid Beam config: " + "; ".join(problems))

    # ---- derived layout -------------------------------------------------------------------
    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @property
    def sliding_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == SLIDING]

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def q_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def num_residual_adds(self) -> int:
        return 2 * self.num_hidden_layers

    # ---- parameter counts -------------------------------------------------------------------
    def _attention_params(self) -> int:
        h = self.hidden_size
        proj = h * self.q_width * 3 + h * self.kv_width * 2  # q, gate, o  +  k, v
        return proj + self.num_attention_heads + 2 * self.head_dim  # gate bias, q/k norms

    def _expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    def _router_params(self) -> int:
        return self.n_routed_experts * self.hidden_size + self.n_routed_experts

    def _count(self, experts_per_layer: int) -> int:
        h = self.hidden_size
        total = 2 * self.vocab_size * h + h  # embedding, head, final norm
        for i in range(self.num_hidden_layers):
            total += self._attention_params() + 4 * h
            if self.is_moe_layer(i):
                total += self._router_params() + experts_per_layer * self._expert_params()
            else:
                total += 3 * h * self.intermediate_size
        return total

    @property
    def num_parameters(self) -> int:
        return self._count(self.n_routed_experts)

    @property
    def num_active_parameters(self) -> int:
        """All parameters but the unselected experts (embedding and head counted whole, as published)."""
        return self._count(self.num_experts_per_tok)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV bytes per token of history: only full-attention layers keep every token."""
        return len(self.full_attention_layers) * 2 * self.kv_width * dtype_bytes

    def swa_kv_bytes(self, dtype_bytes: int = 2) -> int:
        """KV bytes a sequence holds in sliding-window layers at most (one window per layer)."""
        return len(self.sliding_layers) * 2 * self.kv_width * dtype_bytes * self.sliding_window

    # ---- (de)serialisation ----------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def config_hash(self) -> str:
        """Hash of the architecture fields (the preset name is a label, not architecture)."""
        d = self.to_dict()
        d.pop("preset")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, d: dict) -> "BeamConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"config.json has unknown fields {unknown}")
        return cls(**d)

    def save_pretrained(self, path: str, quantization_config: dict | None = None) -> None:
        """config.json: the architecture, and the weights' format where they are quantized."""
        os.makedirs(path, exist_ok=True)
        d = self.to_dict()
        if quantization_config is not None:
            d[QUANTIZATION_CONFIG] = quantization_config
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(d, f, indent=2)
            f.write("\n")

    @classmethod
    def from_pretrained(cls, path: str) -> "BeamConfig":
        """The architecture of a checkpoint folder. Its weights' format, `quantization_config`, is not
        architecture: `beam_model.quant.scheme.read_config` reads both."""
        d = read_config_json(path)
        d.pop(QUANTIZATION_CONFIG, None)
        return cls.from_dict(d)

    @classmethod
    def from_preset(cls, name: str) -> "BeamConfig":
        if name not in PRESETS:
            raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
        return cls(**PRESETS[name], preset=name)


PRESETS: dict[str, dict] = {
    # The published model.
    "beam-501b": {},
    # One tensor-parallel rank of TP8: heads, FFN widths and the vocab-parallel head sliced 1/8,
    # router replicated. Run alone it is a single rank whose all-reduce is the identity.
    "beam-501b-tp8": dict(
        num_attention_heads=6, num_key_value_heads=1, intermediate_size=2560,
        moe_intermediate_size=320, vocab_size=16384,
    ),
    # That rank with the first 26 of its 52 layers in the same pattern (3 dense; full attention at 5, 11, 17,
    # 23 and the last): ~59 GB in BF16, so it runs on an 80 GB GPU. Its layers are the rank's, so ratios
    # between builds (a lock against the reference, a verify step against a decode step) stay close to the
    # rank's; its step times are about half.
    "beam-501b-tp8-half": dict(
        num_attention_heads=6, num_key_value_heads=1, intermediate_size=2560,
        moe_intermediate_size=320, vocab_size=16384, num_hidden_layers=26,
    ),
    # A few GB in BF16: functional GPU tests and the server benchmark.
    "beam-small": dict(
        vocab_size=32768, hidden_size=2048, num_hidden_layers=12, num_attention_heads=16,
        num_key_value_heads=2, intermediate_size=5632, moe_intermediate_size=512,
        n_routed_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4,
        max_position_embeddings=131072,
    ),
    # The trained default (`workbench train`, models/beam-mini): every structural feature at a size that
    # trains in minutes on one GPU; the vocabulary is its tokenizer's. Layers 5 and 7 are full attention.
    "beam-mini": dict(
        vocab_size=8192, hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, sliding_window=128, first_k_dense_replace=1, intermediate_size=768, moe_intermediate_size=128,
        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, max_position_embeddings=4096,
    ),
    # CPU tests: every structural feature, tiny widths. Layers 5 and 6 are full attention.
    "beam-tiny": dict(
        vocab_size=288, hidden_size=64, num_hidden_layers=7, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=16, first_k_dense_replace=2,
        intermediate_size=128, moe_intermediate_size=32, n_routed_experts=16,
        num_experts_per_tok=4, n_group=4, topk_group=2, max_position_embeddings=4096,
    ),
}


QUANTIZATION_CONFIG = "quantization_config"


def read_config_json(path: str) -> dict:
    """A checkpoint folder's config.json as a dict; a missing or malformed file is named."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no config.json in {path}")
    with open(file) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(d).__name__}")
    return d
