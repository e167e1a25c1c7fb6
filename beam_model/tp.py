"""Tensor and expert parallelism in the gpt-fast style: rewrite a model into one rank's shard.

Nothing in the layers or the fusion-point variants knows about tensor parallelism. This module
turns a full `BeamForCausalLM` (or a full checkpoint folder) into the model of one rank: a plain
`BeamForCausalLM` built from `shard_config(config, world_size)` that holds this rank's slices of
the weights, plus a `TensorParallel` object in `model.tp`. The model touches `model.tp` at three
places only (see model.py): the vocab-parallel embedding (`tp.embed`: local lookup, all-reduce
sum), the boundary point (`group=tp.reduce_group`: all-reduce of each sub-layer's partial output before
the post-norm) and the head (`tp.gather_logits`: all-gather of the vocab slices, in rank order).

The split (Megatron layout; every split is one contiguous, equal block along one dimension, so a
rank's slice is `tensor.chunk(world_size, dim)[rank]`):
- attention: q / gate projections and gate_bias by query heads, k / v projections by kv heads
  (GQA: with contiguous blocks rank r's query heads use exactly rank r's kv heads), o_proj by its
  input columns (row-parallel: each rank produces a partial sum). q_norm / k_norm are per
  head_dim, shared by every head, so they are replicated. With more ranks than kv heads (a multiple
  of them), each rank holds the one kv head its query heads read, as vLLM does: the W/kv ranks of a
  kv head's query group each keep a copy of it (`kv_block`).
- dense MLP: gate / up rows, down columns. MoE: every expert is sliced the same way (gate / up
  rows, down columns of its own d_ff); the router and its correction bias are replicated, so
  every rank routes identically and its experts' partial sums add up in the boundary all-reduce.
  With `expert_parallel`, the MoE layers are split by whole experts instead (rank r holds experts
  [r*E/W, (r+1)*E/W)): every rank routes all of its tokens, keeps the routed pairs whose expert it
  holds (`TensorParallel.local_experts`: the others weigh 0), and the same all-reduce sums the ranks'
  partial combines. Attention, the dense layers, the embedding and the head stay tensor-parallel.
- embedding and lm_head: the rows of this rank's vocabulary block [rank*V/W, (rank+1)*V/W).
- every norm (layer norms, final norm) is replicated.
- a quantized projection (FP8 or NVFP4, beam_model/quant) splits its codes as its weight would, and its
  scales along the dimensions they have (`split_dim`); NVFP4's block scales need each rank's slice of
  the inputs to hold whole 16-element blocks (`check_shardable` says where not).
The KV cache needs nothing special: built from the shard's config it holds this rank's kv heads.

What it never does: it never initialises or destroys process groups (the caller does, and passes
the group in); it never pads a dimension that does not divide, and replicates none but the kv heads
(`shard_config` raises a ValueError naming every offender instead); it never communicates while
sharding (`shard_model` and `load_shard` only slice local tensors; each rank reads its own slices); it
never modifies the full model; it does no sequence parallelism and no all-to-all (expert parallelism
sums through the boundary's all-reduce, as within one NVLink domain); and it does not change any
numerics other than the order of the partial-sum additions in the all-reduces.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.distributed as dist

from beam_model.config import PRESETS, BeamConfig
from beam_model.model import BeamForCausalLM

# Sharded fields of the config: each is divided by the world size (under expert parallelism the experts'
# own width stays whole and their count must divide instead). The kv heads divide too, or replicate
# where the ranks outnumber them (`shard_config`).
_SPLIT_FIELDS = ("num_attention_heads", "intermediate_size", "moe_intermediate_size", "vocab_size")
_EXPERT_FIELDS = ("moe_intermediate_size",)

_L = r"model\.layers\.\d+\."
# (parameter name pattern, dimension split across ranks or None for replicated). Model names keep
# the experts stacked ([E, ff, hidden] / [E, hidden, ff]); checkpoint names store one tensor per
# expert ([ff, hidden] / [hidden, ff]). A name matching no rule is an error, never replicated.
_RULES: list[tuple[re.Pattern, int | None]] = [(re.compile(p), d) for p, d in [
    (r"model\.embed_tokens\.weight|lm_head\.weight", 0),
    (_L + r"self_attn\.((q_proj|k_proj|v_proj|gate_proj)\.weight|gate_bias)", 0),
    (_L + r"self_attn\.o_proj\.weight", 1),
    (_L + r"self_attn\.(q_norm|k_norm)\.weight", None),
    (_L + r"mlp\.(gate_proj|up_proj)\.weight", 0),
    (_L + r"mlp\.down_proj\.weight", 1),
    (_L + r"mlp\.experts\.(gate_proj|up_proj)", 1),
    (_L + r"mlp\.experts\.down_proj", 2),
    (_L + r"mlp\.experts\.\d+\.(gate_proj|up_proj)\.weight", 0),
    (_L + r"mlp\.experts\.\d+\.down_proj\.weight", 1),
    (_L + r"mlp\.gate\.(weight|e_score_correction_bias)", None),
    (_L + r"(input|post_attention|pre_feedforward|post_feedforward)_layernorm\.weight", None),
    (r"model\.norm\.weight", None),
]]


def shard_config(config: BeamConfig, world_size: int, expert_parallel: bool = False) -> BeamConfig:
    """One rank's config: heads, kv heads, both FFN widths and the vocabulary divided by world_size (one
    kv head a rank where the ranks outnumber the kv heads, a multiple of them; under expert parallelism
    the experts' width stays whole: the rank holds E/world_size whole experts, a count the config does
    not carry, since the router still scores all E).

    Everything else (hidden size, head_dim, layers, router, expert counts...) is unchanged. The
    preset label becomes `<preset>-tp<world_size>` when that preset exists, else None."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    fields = [f for f in _SPLIT_FIELDS if not (expert_parallel and f in _EXPERT_FIELDS)]
    divided = fields + ["n_routed_experts"] * expert_parallel
    bad = [f"{f}={getattr(config, f)} not divisible by {world_size}" for f in divided
           if getattr(config, f) % world_size]
    kv = config.num_key_value_heads
    if kv % world_size and world_size % kv:  # fewer kv heads than ranks replicate; they must divide them
        bad.append(f"num_key_value_heads={kv} neither divisible by {world_size} nor dividing it")
    if bad:
        raise ValueError(f"cannot shard the config over {world_size} ranks: {', '.join(bad)}")
    if expert_parallel and config.n_routed_experts // world_size < config.num_experts_per_tok:
        raise ValueError(f"expert parallelism over {world_size} ranks leaves {config.n_routed_experts // world_size} "
                         f"experts a rank, fewer than top_k = {config.num_experts_per_tok}")
    if world_size == 1:
        return dataclasses.replace(config, layer_types=list(config.layer_types))
    label = f"{config.preset}-tp{world_size}" if config.preset and not expert_parallel else None
    return dataclasses.replace(
        config, layer_types=list(config.layer_types), preset=label if label in PRESETS else None,
        **{f: getattr(config, f) // world_size for f in fields}, num_key_value_heads=max(1, kv // world_size))


def check_shardable(config: BeamConfig, world_size: int, expert_parallel: bool = False, quant=None) -> None:
    """Raise a ValueError naming what does not divide over `world_size` ranks (in `quant`'s format)."""
    _shard_layout(config, world_size, torch.bfloat16, expert_parallel, quant)


def _shard_layout(full_config: BeamConfig, world_size: int, dtype, expert_parallel: bool, quant) -> BeamForCausalLM:
    config = shard_config(full_config, world_size, expert_parallel)
    try:
        return BeamForCausalLM(config, dtype, quant)
    except ValueError as e:  # a quantized projection's rank slice that its format cannot store
        if quant is None:
            raise
        raise ValueError(f"a {quant.format} model does not shard over {world_size} ranks: {e}") from e


def _rank_model(full_config: BeamConfig, rank: int, world_size: int, dtype, group,
                expert_parallel: bool, quant=None) -> BeamForCausalLM:
    """A meta-device model of one rank's shapes (its projections stored as `quant` says) and its
    `model.tp`; under expert parallelism each MoE layer's stacks hold the rank's E/world_size experts."""
    model = _shard_layout(full_config, world_size, dtype, expert_parallel, quant)
    experts = None
    if expert_parallel and world_size > 1:
        count = full_config.n_routed_experts // world_size
        experts = (rank * count, count)
        for layer in model.model.layers:
            stack = getattr(layer.mlp, "experts", None)
            # every tensor of a stack leads with the expert: codes, scales and per-expert global scales
            for name, full in list(stack.named_parameters(recurse=False)) if stack is not None else ():
                setattr(stack, name, torch.nn.Parameter(torch.empty(count, *full.shape[1:], device="meta",
                                                                    dtype=full.dtype), requires_grad=False))
    model.tp = TensorParallel(group, rank, world_size, experts)
    return model


_STACKED_EXPERTS = re.compile(_L + r"mlp\.experts\.(gate_proj|up_proj|down_proj)")
_ONE_EXPERT = re.compile(r"(" + _L + r"mlp\.experts\.)(\d+)(\.(gate_proj|up_proj|down_proj)\."
                         r"(weight|weight_scale|weight_scale_2|input_scale))")


def split_dim(name: str, expert_parallel: bool = False, fmt: str | None = None) -> int | None:
    """The dimension along which parameter / checkpoint tensor `name` is split, None if replicated (under
    expert parallelism an experts stack splits by expert; one expert's checkpoint tensor belongs to one
    rank whole, as `expert_owner` says). A quantized projection's (`fmt`) codes split as its weight would;
    its scales follow the codes along the dimensions they have: FP8's one scale per output row is whole
    on a row-parallel rank, NVFP4's per-16-input block scales split with the inputs, and the one global
    scale of a projection (of each expert in a stack) splits only by expert."""
    part = _scale_part(name)
    if part is not None:
        codes, role = part
        dim = split_dim(codes, expert_parallel)
        ndim = 3 if _STACKED_EXPERTS.fullmatch(codes) else 2  # the codes': [E,] out, in
        if dim is None:
            return None
        if role == "scale":
            return None if fmt == "fp8" and dim == ndim - 1 else dim
        return dim if dim < ndim - 2 else None
    if expert_parallel and _STACKED_EXPERTS.fullmatch(name):
        return 0
    for pattern, dim in _RULES:
        if pattern.fullmatch(name):
            return dim
    raise KeyError(f"tensor {name!r} has no tensor-parallel rule in beam_model/tp.py")


def _scale_part(name: str) -> tuple[str, str] | None:
    """(name of the codes, role) of a quantized projection's scale tensor (beam_model/quant/layout.py
    names them: a Linear's `weight_scale`, `weight_scale_2`, `input_scale`; an experts stack's
    `<proj>_scale`, `<proj>_scale_2`, `<proj>_input_scale`); None for any other tensor."""
    if name.endswith(".input_scale"):
        return name[:-len("input_scale")] + "weight", "input_scale"
    for suffix, role in (("_input_scale", "input_scale"), ("_scale_2", "scale_2"), ("_scale", "scale")):
        if name.endswith(suffix):
            return name[:-len(suffix)], role
    return None


def expert_owner(name: str, n_experts: int, world_size: int) -> tuple[int, str] | None:
    """Under expert parallelism, the rank holding checkpoint tensor `name` of one expert and the name it
    has in that rank's stack (its index there); None for any other tensor."""
    m = _ONE_EXPERT.fullmatch(name)
    if m is None:
        return None
    per_rank = n_experts // world_size
    e = int(m.group(2))
    return e // per_rank, f"{m.group(1)}{e % per_rank}{m.group(3)}"


_KV = re.compile(_L + r"self_attn\.(k_proj|v_proj)\.")  # a kv projection's weight and its scales


def kv_block(name: str, rank: int, world_size: int, kv_heads: int) -> tuple[int, int]:
    """(block, blocks): tensor `name`'s split dimension cut into `blocks` equal blocks, this rank's is
    number `block`. Every tensor cuts into a block per rank, but a kv projection of a model with fewer kv
    heads than ranks cuts into a block per kv head, and the W/kv ranks of a kv head's query group share it."""
    if kv_heads < world_size and _KV.match(name):
        return rank // (world_size // kv_heads), kv_heads
    return rank, world_size


def shard_tensor(name: str, tensor: torch.Tensor, rank: int, world_size: int, kv_heads: int,
                 expert_parallel: bool = False, fmt: str | None = None) -> torch.Tensor:
    """This rank's slice of a full tensor of a model with `kv_heads` kv heads (a view; the whole tensor
    when replicated)."""
    dim = split_dim(name, expert_parallel, fmt)
    if dim is None or world_size == 1:
        return tensor
    block, blocks = kv_block(name, rank, world_size, kv_heads)
    size = tensor.shape[dim]
    if size % blocks:
        raise ValueError(f"{name}: dimension {dim} of shape {list(tensor.shape)} does not divide by {blocks}")
    n = size // blocks
    return tensor.narrow(dim, block * n, n)


class TensorParallel:
    """One rank's place in a tensor-parallel group, the two collectives the model calls itself, and under
    expert parallelism the experts it holds (`experts`: the first one's id and how many)."""

    def __init__(self, group, rank: int, world_size: int, experts: tuple[int, int] | None = None):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of size {world_size}")
        if world_size > 1:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError("tensor parallelism over several ranks needs an initialised torch.distributed")
            group = group if group is not None else dist.group.WORLD
            actual = (dist.get_rank(group), dist.get_world_size(group))
            if actual != (rank, world_size):
                raise ValueError(f"rank {rank} of {world_size} does not match the process group "
                                 f"(rank {actual[0]} of {actual[1]})")
        self.group = group  # None only in a world of 1: the boundary then skips its all-reduce
        self.rank = rank
        self.world_size = world_size
        self.experts = experts

    def __repr__(self) -> str:
        ep = f", experts={self.experts}" if self.experts else ""
        return f"TensorParallel(rank={self.rank}, world_size={self.world_size}{ep})"

    def local_experts(self, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed pairs as this rank's experts see them: ids in its stack, and weight 0 for a pair
        whose expert another rank holds. Such a pair takes a local expert its token does not use, the
        lowest free ones in slot order, so a token's ids stay distinct as the `experts` contract has them
        (a rank holds at least top_k experts: `shard_config`); the zero weight drops its output. Without
        expert parallelism, unchanged. No host sync: graph-capturable."""
        if self.experts is None:
            return ids, weights
        first, count = self.experts
        local = ids - first
        mine = (local >= 0) & (local < count)
        slots = torch.where(mine, local, 0)  # other ranks' pairs add 0 at id 0: a sum, never an overwrite
        uses = torch.zeros(ids.shape[0], count, dtype=torch.long, device=ids.device).scatter_add_(1, slots, mine.long())
        order = torch.arange(count, device=ids.device)
        free = torch.sort((uses > 0).long() * count + order, dim=1).indices  # unused local ids first, ascending
        nth_other = (~mine).long().cumsum(1) - 1  # a pair of another rank's: its place among them
        spare = free.gather(1, nth_other.clamp(min=0))
        return torch.where(mine, local, spare), weights * mine

    def _reduces(self) -> bool:
        return self.world_size > 1 and self.group is not None

    @property
    def reduce_group(self):
        """The group the boundaries all-reduce over: None in a world of one, where a rank's partial sum is the
        whole sum, so the boundaries skip the collective as the embedding and the logits skip theirs."""
        return self.group if self._reduces() else None

    def embed(self, weight: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: weight is this rank's [V/W, hidden] block; ids outside it give
        zeros, then an all-reduce sum gives every rank the full embedding. Ids >= the full
        vocabulary give zeros rather than an error (no host sync)."""
        if self.world_size == 1:
            return weight[input_ids]
        rows = weight.shape[0]
        local = input_ids - self.rank * rows
        outside = (local < 0) | (local >= rows)
        out = weight[local.clamp(0, rows - 1)].masked_fill(outside[..., None], 0)
        if self._reduces():
            dist.all_reduce(out, group=self.group)
        return out

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V/W] vocab slice -> [..., V] full logits on every rank, slices in rank order."""
        if not self._reduces():
            return logits
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.world_size)]
        dist.all_gather(parts, logits, group=self.group)
        return torch.cat(parts, dim=-1)


def _selection(full_model: BeamForCausalLM) -> dict[str, str] | None:
    return full_model.ops.selection if full_model.ops is not None else None


@torch.no_grad()
def shard_model(full_model: BeamForCausalLM, rank: int, world_size: int, group=None, *,
                expert_parallel: bool = False) -> BeamForCausalLM:
    """A new model with `shard_config` shapes holding this rank's slices of `full_model`'s weights.

    The slices are copies on the full model's device and in its dtypes (the full model is left
    untouched and can be dropped afterwards). The shard gets `model.tp` and the full model's
    variant selection. `group` None means the default group when world_size > 1."""
    from beam_model.weights import _set_param

    model = _rank_model(full_model.config, rank, world_size, full_model.dtype, group, expert_parallel,
                        full_model.quant)
    fmt = full_model.quant.format if full_model.quant is not None else None
    full = dict(full_model.named_parameters())
    for name, p in list(model.named_parameters()):
        src = full[name]
        if src.is_meta:
            raise ValueError(f"full model parameter {name} is not materialised (meta device)")
        t = shard_tensor(name, src, rank, world_size, full_model.config.num_key_value_heads, expert_parallel,
                         fmt).clone(memory_format=torch.contiguous_format)
        if t.shape != p.shape:
            raise ValueError(f"{name}: slice has shape {list(t.shape)}, the shard expects {list(p.shape)}")
        _set_param(model, name, t)
    model.set_variants(_selection(full_model))
    return model


@torch.no_grad()
def load_shard(path: str, rank: int, world_size: int, group=None, dtype=torch.bfloat16, device=None, *,
               variants: dict[str, str] | None = None, expert_parallel: bool = False) -> BeamForCausalLM:
    """Load this rank's shard straight from a full checkpoint folder.

    Names and shapes are checked against the full config first (like `load_checkpoint`); then
    each tensor's slice is read from the safetensors files on the CPU (only the slice, never the
    whole tensor) and copied to `device` in `dtype` (the router stays FP32). Every rank reads its
    own slices; nothing is communicated."""
    from safetensors import safe_open

    from beam_model.quant.scheme import read_config
    from beam_model.weights import (
        _target,
        by_file,
        check_stored_values,
        checked_files,
        checkpoint_tensors,
        materialize,
        stored_dtypes,
    )

    device = torch.device(device) if device is not None else torch.device("cpu")
    full_config, quant = read_config(path)
    fmt = quant.format if quant is not None else None
    model = _rank_model(full_config, rank, world_size, dtype, group, expert_parallel, quant)

    full = checkpoint_tensors(BeamForCausalLM(full_config, dtype, quant))
    expected = {n: tuple(t.shape) for n, t in full.items()}
    files = checked_files(path, expected, stored_dtypes(full), f"{fmt} checkpoint" if fmt else "checkpoint")
    params = materialize(model, device)
    for file, names in by_file(files).items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in names:
                owner = expert_owner(name, full_config.n_routed_experts, world_size) if expert_parallel else None
                if owner is not None:  # one expert, whole, on the rank that holds it
                    if owner[0] == rank:
                        _target(params, owner[1]).copy_(f.get_tensor(name))
                    continue
                dim = split_dim(name, expert_parallel, fmt)
                if dim is None or world_size == 1:
                    t = f.get_tensor(name)
                else:
                    block, blocks = kv_block(name, rank, world_size, full_config.num_key_value_heads)
                    n = expected[name][dim] // blocks
                    index = (slice(None),) * dim + (slice(block * n, (block + 1) * n),)
                    t = f.get_slice(name)[index]
                _target(params, name).copy_(t)
    check_stored_values(model, path)
    model.set_variants(variants)
    return model
