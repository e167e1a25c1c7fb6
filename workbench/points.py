"""What the harness knows about each fusion point: inputs for a workload, bytes, FLOPs, tolerances.

Each `workbench/variants/<point>.py` declares its point's `PointSpec` with `declare(...)` beside
its variants. Gates and timing use only this: they generate inputs from the spec, compute the
roofline floor from its bytes and FLOPs, and judge outputs by its tolerance policy. Variants never
compute their own metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from beam_model.config import BeamConfig
from workbench.registry import POINTS, variants


@dataclass(frozen=True)
class Workload:
    """The problem size a point is called at: a preset's shapes, a batch and a context."""

    preset: str = "beam-tiny"
    batch: int = 1            # sequences in the step
    tokens_per_seq: int = 1   # 1 = decode; > 1 = prefill (chunk) tokens per sequence
    context: int = 64         # KV length per sequence after the step (>= tokens_per_seq)
    layer: str = "sliding"    # "sliding" or "full": attention and qk_prep depend on it
    dtype: str = "bf16"

    @property
    def tokens(self) -> int:
        return self.batch * self.tokens_per_seq

    @property
    def config(self) -> BeamConfig:
        return BeamConfig.from_preset(self.preset)

    def with_(self, **kw) -> "Workload":
        return replace(self, **kw)

    def label(self) -> str:
        kind = "decode" if self.tokens_per_seq == 1 else f"prefill{self.tokens_per_seq}"
        return f"{self.preset} b{self.batch} {kind} ctx{self.context} {self.layer} {self.dtype}"


@dataclass
class Call:
    """One invocation: positional and keyword arguments. `weights` names the argument that holds
    the point's weights dict, so a variant's weight-layout transform can be applied to it."""

    args: tuple
    kwargs: dict = field(default_factory=dict)
    weights_arg: int | None = None  # index into args of the weights dict, if the point has weights

    def with_weights(self, weights) -> "Call":
        """The same call with its weights argument replaced (e.g. by a variant's weight layout)."""
        if self.weights_arg is None:
            return self
        args = list(self.args)
        args[self.weights_arg] = weights
        return Call(tuple(args), dict(self.kwargs), self.weights_arg)


@dataclass
class PointSpec:
    name: str
    make_inputs: Callable[[Workload, Any, int], Call]  # (workload, device, seed) -> Call
    bytes: Callable[[Workload], int]                  # fewest bytes one call must move
    flops: Callable[[Workload], int]
    tolerance: dict[str, float]                       # dtype name -> max relative error vs FP64/FP32 ref
    inplace: tuple[str, ...] = ()                     # kwargs the contract allows to be written
    compare: Callable | None = None                   # custom comparison (routing sets, sampling stats)


_SPECS: dict[str, PointSpec] = {}


def declare(spec: PointSpec) -> PointSpec:
    if spec.name not in POINTS:
        raise KeyError(f"unknown fusion point {spec.name!r}")
    _SPECS[spec.name] = spec
    return spec


def spec(point: str) -> PointSpec:
    variants(point)  # imports the point's module, which declares the spec
    if point not in _SPECS:
        raise KeyError(f"fusion point {point!r} declares no PointSpec")
    return _SPECS[point]
