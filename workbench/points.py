"""What the harness knows about each fusion point: inputs for a workload, bytes, FLOPs, tolerances.

Each `workbench/variants/<point>.py` declares its point's `PointSpec` with `declare(...)` beside
its variants. Gates and timing use only this: they generate inputs from the spec, compute the
roofline floor from its bytes and FLOPs, and judge outputs by its tolerance policy. Variants never
compute their own metrics.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from beam_model.config import BeamConfig
from workbench.registry import POINTS, quantized_by, variants

# Points whose inputs depend on the layer kind (window, RoPE or NoPE, cache group); the others see the
# same shapes and values in sliding-window and full-attention layers.
LAYER_DEPENDENT = ("qk_prep", "attention", "attention_out")
# Points the model runs once per step, after the last layer (the profiler's "model" kind), on each
# sequence's last new token only: a prefill of 8 x 2048 tokens samples 8 rows, not 16384.
STEP_POINTS = ("head", "sample")


def step_kinds(point: str) -> tuple[str, ...]:
    """The kinds of call (`Target.workload`'s layer_kind) at which a point runs in a step."""
    if point in STEP_POINTS:
        return ("model",)
    return ("sliding", "full") if point in LAYER_DEPENDENT else ("sliding",)


@dataclass(frozen=True)
class Workload:
    """The problem size a point is called at: a preset's shapes, a batch and a context."""

    preset: str = "beam-tiny"
    batch: int = 1            # sequences in the step
    tokens_per_seq: int = 1   # 1 = decode; > 1 = prefill (chunk) tokens per sequence
    context: int = 64         # KV length per sequence after the step (>= tokens_per_seq)
    layer: str = "sliding"    # "sliding" or "full": attention and qk_prep depend on it
    dtype: str = "bf16"
    weights: str = "bf16"     # the projections' stored format: "bf16" (the model dtype), "fp8" or "nvfp4"

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
        weights = "" if self.weights == "bf16" else f" {self.weights} weights"
        return f"{self.preset} b{self.batch} {kind} ctx{self.context} {self.layer} {self.dtype}{weights}"


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


# ---- walking a call's arguments: tuples, lists, dicts and dataclasses (attention metadata) -----------

def named_leaves(obj, path: str = "") -> list[tuple[str, Any]]:
    """(path, leaf) for every tensor and generator inside `obj` (a Call, or any of its arguments)."""
    if isinstance(obj, Call):
        return named_leaves(obj.args, "args") + named_leaves(obj.kwargs, "kwargs")
    if isinstance(obj, (torch.Tensor, torch.Generator)):
        return [(path, obj)]
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in named_leaves(v, f"{path}[{k!r}]")]
    if isinstance(obj, (list, tuple)):
        return [x for i, v in enumerate(obj) for x in named_leaves(v, f"{path}[{i}]")]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [x for f in dataclasses.fields(obj) for x in named_leaves(getattr(obj, f.name), f"{path}.{f.name}")]
    return []


def leaves(obj) -> list:
    """The tensors and generators inside `obj`, in a fixed order."""
    return [leaf for _, leaf in named_leaves(obj)]


def map_leaves(obj, tensor_fn, generator_fn=lambda g: g):
    """The same structure with each tensor replaced by tensor_fn(t), each generator by generator_fn(g);
    ints, floats and host-side metadata are shared (never written)."""
    if isinstance(obj, Call):
        return Call(map_leaves(obj.args, tensor_fn, generator_fn), map_leaves(obj.kwargs, tensor_fn, generator_fn),
                    obj.weights_arg)
    if isinstance(obj, torch.Tensor):
        return tensor_fn(obj)
    if isinstance(obj, torch.Generator):
        return generator_fn(obj)
    if isinstance(obj, dict):
        return {k: map_leaves(v, tensor_fn, generator_fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_leaves(v, tensor_fn, generator_fn) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: map_leaves(getattr(obj, f.name), tensor_fn, generator_fn)
                                          for f in dataclasses.fields(obj) if f.init})
    return obj


@dataclass
class PointSpec:
    name: str
    inputs: Callable[[Workload, Any, int], Call]      # (workload, device, seed) -> Call, BF16 weights
    bytes: Callable[[Workload], int]                  # fewest bytes one call must move
    flops: Callable[[Workload], int]
    tolerance: dict[str, float]                       # dtype name -> max relative error vs FP64/FP32 ref
    inplace: tuple[str, ...] = ()                     # kwargs the contract allows to be written
    compare: Callable | None = None                   # custom comparison (routing sets, sampling stats)
    # Weight format -> the keys of the weights dict that format stores quantized (beam_model.quant.scheme
    # says which checkpoint modules; these are the same projections as this point receives them)
    quantized: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Activation format -> max relative error vs the FP64 reference for a variant that quantizes its
    # activations to that format (Variant.activations), whatever the dtype: the rounding it adds beside
    # the weights' (each point's value says which measurement sets it). A point without one refuses them.
    activation_tolerance: dict[str, float] = field(default_factory=dict)
    # The argument each tensor-parallel rank holds a partial sum of, which the contract all-reduces over
    # its `group` (workbench/rank_gate.py gates that); None: the point never communicates
    partial_sum: int | None = None

    def tolerance_for(self, dtype: str, activations: str | None = None, weights: str = "bf16") -> float:
        """The max relative error a variant computing in `dtype` may have; one that quantizes its
        activations to a format (Variant.activations) is held to the point's tolerance for that format
        where the weights are stored in it too (W8A8), and to the dtype's anywhere else: declaring it
        buys no slack on weights it does not apply to."""
        if activations is None or activations != weights:
            return self.tolerance[dtype]
        if activations not in self.activation_tolerance:
            raise ValueError(f"{self.name} declares no tolerance for {activations} activations "
                             f"(PointSpec.activation_tolerance): its variants must not quantize them")
        return self.activation_tolerance[activations]

    def make_inputs(self, workload: Workload, device, seed: int) -> Call:
        """The point's inputs at `workload`, its weights stored in the workload's format: drawn in BF16,
        then quantized as `workbench quantize` writes them."""
        call = self.inputs(workload, device, seed)
        keys = self.quantized.get(workload.weights, ())
        if workload.weights != "bf16" and call.weights_arg is not None and keys:
            from beam_model.quant.tensors import quantize

            w = call.args[call.weights_arg]
            call = call.with_weights({k: quantize(v, workload.weights) if k in keys else v for k, v in w.items()})
        return call


    def rank_inputs(self, workload: Workload, device, seed: int, rank: int) -> Call:
        """The inputs tensor-parallel `rank` sees: those of `seed`, its own partial sum (`partial_sum`)
        drawn from seed + 1000 * rank, so every rank holds the same other inputs."""
        call = self.make_inputs(workload, device, seed)
        if rank == 0:
            return call
        args = list(call.args)
        args[self.partial_sum] = self.make_inputs(workload, device, seed + 1000 * rank).args[self.partial_sum]
        return Call(tuple(args), call.kwargs, call.weights_arg)


_SPECS: dict[str, PointSpec] = {}


def declare(spec: PointSpec) -> PointSpec:
    if spec.name not in POINTS:
        raise KeyError(f"unknown fusion point {spec.name!r}")
    _SPECS[spec.name] = spec
    quantized_by(spec.name, tuple(spec.quantized))  # what the variants' `formats` are checked against
    return spec


def spec(point: str) -> PointSpec:
    variants(point)  # imports the point's module, which declares the spec
    if point not in _SPECS:
        raise KeyError(f"fusion point {point!r} declares no PointSpec")
    return _SPECS[point]
