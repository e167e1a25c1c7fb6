"""Which tensors of a checkpoint a `quantization_config` quantizes, and what each must look like.

`QuantScheme.from_config(d)` reads config.json's `quantization_config` (ModelOpt: `quant_method`
"modelopt", `quant_algo` FP8_PER_CHANNEL_PER_TOKEN or NVFP4, `exclude_modules` as glob patterns over
module names, `group_size` 16 for NVFP4) and refuses anything else, naming the field. A module is
quantized when its format covers it (FP8: attention q/k/v/gate/o, dense gate/up/down and every expert's
gate/up/down; NVFP4: the experts') and no pattern of `exclude_modules` matches it. `expected(shapes)`
turns the BF16 names and shapes of a config into the quantized checkpoint's names, shapes and dtypes.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from beam_model.config import QUANTIZATION_CONFIG, BeamConfig, read_config_json
from beam_model.quant.formats import NVFP4_BLOCK

FP8 = "FP8_PER_CHANNEL_PER_TOKEN"
NVFP4 = "NVFP4"
FORMATS = {"fp8": FP8, "nvfp4": NVFP4}
_ATTENTION = re.compile(r"^model\.layers\.\d+\.self_attn\.(q|k|v|gate|o)_proj$")
_DENSE = re.compile(r"^model\.layers\.\d+\.mlp\.(gate|up|down)_proj$")
_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj$")
ALWAYS_EXCLUDED = ["lm_head", "model.embed_tokens", "*.mlp.gate"]


class QuantConfigError(ValueError):
    """A quantization_config that names a method, algorithm or field this code does not read."""


@dataclass(frozen=True)
class QuantScheme:
    algo: str
    exclude_modules: tuple[str, ...]

    @classmethod
    def for_format(cls, fmt: str) -> "QuantScheme":
        """The scheme `workbench quantize --format fmt` writes."""
        if fmt not in FORMATS:
            raise QuantConfigError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
        algo = FORMATS[fmt]
        excluded = ALWAYS_EXCLUDED if algo == FP8 else \
            [*ALWAYS_EXCLUDED, "*.self_attn.*", "*.mlp.gate_proj", "*.mlp.up_proj", "*.mlp.down_proj"]
        return cls(algo, tuple(excluded))

    @classmethod
    def from_config(cls, d) -> "QuantScheme":
        if not isinstance(d, dict):
            raise QuantConfigError(f"quantization_config must be an object, got {type(d).__name__}")
        if d.get("quant_method") != "modelopt":
            raise QuantConfigError(f"quantization_config.quant_method is {d.get('quant_method')!r}; only "
                                   "'modelopt' checkpoints are read")
        algo = d.get("quant_algo")
        if algo not in (FP8, NVFP4):
            raise QuantConfigError(f"quantization_config.quant_algo is {algo!r}; known: {FP8}, {NVFP4}")
        if algo == NVFP4 and d.get("group_size", NVFP4_BLOCK) != NVFP4_BLOCK:
            raise QuantConfigError(f"quantization_config.group_size is {d.get('group_size')!r}; NVFP4 blocks "
                                   f"are {NVFP4_BLOCK} inputs")
        excluded = d.get("exclude_modules", [])
        if not isinstance(excluded, list) or not all(isinstance(p, str) for p in excluded):
            raise QuantConfigError("quantization_config.exclude_modules must be a list of module names or patterns")
        return cls(algo, tuple(excluded))

    def to_config(self) -> dict:
        d = {"quant_method": "modelopt", "quant_algo": self.algo, "exclude_modules": list(self.exclude_modules)}
        return {**d, "group_size": NVFP4_BLOCK} if self.algo == NVFP4 else d

    @property
    def format(self) -> str:
        return next(k for k, v in FORMATS.items() if v == self.algo)

    def quantizes(self, module: str) -> bool:
        covered = bool(_EXPERT.match(module)) if self.algo == NVFP4 else \
            bool(_ATTENTION.match(module) or _DENSE.match(module) or _EXPERT.match(module))
        return covered and not any(fnmatch.fnmatchcase(module, p) for p in self.exclude_modules)


def read_config(path: str) -> tuple[BeamConfig, QuantScheme | None]:
    """The model config of a checkpoint folder and its quantization scheme (None: not quantized)."""
    d = read_config_json(path)
    quant = d.pop(QUANTIZATION_CONFIG, None)
    return BeamConfig.from_dict(d), None if quant is None else QuantScheme.from_config(quant)
