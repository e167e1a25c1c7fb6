"""Weights: deterministic random init on the target device, and safetensors checkpoints.

Random init draws each tensor from its own generator seeded by (seed, tensor name), directly on
the target device and in the target dtype: no host round trip, no full-model temporaries (the TP8
rank is ~125 GB). Scales keep activations O(1) through every layer: linear weights have std
1/sqrt(fan_in), norms are near 1, and the LM head is scaled so that logits reach the soft-cap's
curved range. The same seed gives the same weights on the same device type (CPU and CUDA
generators differ).

Checkpoints use the architecture doc's tensor names; experts are stored one tensor per expert
(`mlp.experts.{e}.gate_proj.weight`, and its scales in a quantized checkpoint) though the model keeps
them stacked. Loading checks names and shapes (and a quantized checkpoint's dtypes) first and names
every missing, unexpected or mis-shaped tensor before reading any data. A quantized model's random
projections are the BF16 model's, quantized (`beam_model.quant.layout`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# A stacked experts tensor of the model (a projection, or a quantized one's scale) and its per-expert name
_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)"
                      r"(_scale|_scale_2|_input_scale)?$")
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\."
                         r"(weight|weight_scale|weight_scale_2|input_scale)$")
_SUFFIXES = {"": "weight", "_scale": "weight_scale", "_scale_2": "weight_scale_2", "_input_scale": "input_scale"}


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: the message names every offending tensor."""


def _init_spec(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of the initial values of one parameter."""
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return 1.0, 0.1
    if name.endswith("gate_bias"):
        return 0.0, 1.0
    if name.endswith("e_score_correction_bias"):
        return 0.0, 0.05
    if name == "model.embed_tokens.weight":
        return 0.0, 1.0
    if name == "lm_head.weight":
        return 0.0, 10.0 / math.sqrt(shape[-1])  # logits of std ~10 against the cap of 30
    return 0.0, 1.0 / math.sqrt(shape[-1])  # [.., out, in]: unit-variance outputs


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)


@torch.no_grad()
def init_random(model, *, seed: int = 0, device=None) -> None:
    """Materialise every parameter of a meta-device model with seeded random values on `device`; a
    quantized projection is drawn in the model dtype, as the BF16 model's, then quantized."""
    from beam_model.quant.layout import assign, logical_shape, quantized_parameters
    from beam_model.quant.tensors import quantize

    device = torch.device(device) if device is not None else torch.device("cpu")
    projections, scales = quantized_parameters(model)
    for name, p in list(model.named_parameters()):
        if name in scales:
            continue  # set with its projection
        owner, attr, fmt = projections.get(name, (None, None, None))
        shape = logical_shape(owner, attr) if owner is not None else tuple(p.shape)
        mean, std = _init_spec(name, shape)
        t = torch.empty(shape, dtype=model.dtype if owner is not None else p.dtype, device=device)
        t.normal_(mean, std, generator=_generator(seed, name, device))
        if owner is not None:
            assign(owner, attr, quantize(t, fmt))
        else:
            _set_param(model, name, t)


def _set_param(model, name: str, value: torch.Tensor) -> None:
    """Replace a (meta) parameter by a real tensor; `.data =` cannot move a parameter off meta."""
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner), attr, torch.nn.Parameter(value, requires_grad=False))


def checkpoint_tensors(model) -> dict[str, torch.Tensor]:
    """The model's tensors under checkpoint names (experts split per expert; views, no copies)."""
    out = {}
    for name, p in model.named_parameters():
        m = _STACKED.match(name)
        if m:
            for e in range(p.shape[0]):
                out[f"{m.group(1)}.{e}.{m.group(2)}.{_SUFFIXES[m.group(3) or '']}"] = p[e]
        else:
            out[name] = p
    return out


MAX_SHARD_BYTES = 5 * 2**30


def save_checkpoint(model, path: str, *, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """config.json plus model.safetensors, or shards with an index when larger than max_shard_bytes."""
    os.makedirs(path, exist_ok=True)
    model.config.save_pretrained(path, model.quant.to_config() if model.quant is not None else None)
    writer = ShardWriter(path, max_shard_bytes)
    for name, t in checkpoint_tensors(model).items():
        writer.add(name, t)
    writer.close()


_WEIGHT_FILE = re.compile(r"^(model\.safetensors(\.index\.json)?|model-\d+-of-\d+\.safetensors|part-\d+\.safetensors)$")


class ShardWriter:
    """Tensors, one at a time, into `path`'s model.safetensors, or into shards of at most `max_bytes`
    (model-00001-of-0000N.safetensors ...) with an index, as Hugging Face checkpoints ship."""

    def __init__(self, path: str, max_bytes: int = MAX_SHARD_BYTES):
        self.path, self.max_bytes = path, max_bytes
        self.pending, self.size, self.files, self.weight_map, self.total = {}, 0, [], {}, 0

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.pending and self.size + nbytes > self.max_bytes:
            self._flush()
        # a copy of its own: safetensors refuses tensors that share storage (per-expert views of one stack)
        self.pending[name] = t.detach().to("cpu").clone()
        self.size += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        file = f"part-{len(self.files) + 1:05d}.safetensors"  # renamed once the count is known
        save_file(self.pending, os.path.join(self.path, file), metadata={"format": "pt"})
        self.files.append(file)
        self.weight_map.update({n: file for n in self.pending})
        self.pending, self.size = {}, 0

    def close(self) -> None:
        if not self.files:
            save_file(self.pending, os.path.join(self.path, SINGLE_FILE), metadata={"format": "pt"})
            self._remove_stale({SINGLE_FILE})
            return
        self._flush()
        n = len(self.files)
        renamed = {f: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, f in enumerate(self.files)}
        for old, new in renamed.items():
            os.replace(os.path.join(self.path, old), os.path.join(self.path, new))
        with open(os.path.join(self.path, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": self.total},
                       "weight_map": {k: renamed[v] for k, v in self.weight_map.items()}}, f, indent=2)
        self._remove_stale({INDEX_FILE, *renamed.values()})

    def _remove_stale(self, written: set[str]) -> None:
        """Weight files an earlier checkpoint left in the folder: a reader would take an old index over the
        new single file, or count old shards beside new ones."""
        for name in os.listdir(self.path):
            if name not in written and _WEIGHT_FILE.match(name):
                os.remove(os.path.join(self.path, name))


def _checkpoint_files(path: str) -> dict[str, str]:
    """Tensor name -> file, from the index or the single file."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
        missing_files = sorted({f for f in weight_map.values() if not os.path.isfile(os.path.join(path, f))})
        if missing_files:
            raise CheckpointError(f"checkpoint shards listed in the index are missing: {missing_files}")
        return {name: os.path.join(path, f) for name, f in weight_map.items()}
    single = os.path.join(path, SINGLE_FILE)
    if not os.path.isfile(single):
        raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def tensor_layout(files: dict[str, str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each tensor's (shape, safetensors dtype name, e.g. "BF16"), read from the files' headers only."""
    layout = {}
    for file in sorted(set(files.values())):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if files.get(name) == file:
                    s = f.get_slice(name)
                    layout[name] = (tuple(s.get_shape()), s.get_dtype())
    return layout


_SAFETENSORS_DTYPES = {torch.float8_e4m3fn: "F8_E4M3", torch.uint8: "U8", torch.float32: "F32",
                       torch.bfloat16: "BF16", torch.float16: "F16"}


def checked_files(path: str, expected: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype] | None = None,
                  what: str = "checkpoint") -> dict[str, str]:
    """Tensor name -> file of a checkpoint whose names and shapes are exactly `expected` (and the dtypes of
    the tensors `dtypes` names); else a CheckpointError naming every missing, unexpected, mis-shaped or
    mis-typed tensor (before any data is read)."""
    files = _checkpoint_files(path)
    found = tensor_layout(files)
    problems = name_problems(expected, found)
    for name, shape in expected.items():
        if name not in found:
            continue
        got_shape, got_dtype = found[name]
        if got_shape != shape:
            problems.append(f"tensor {name} has shape {list(got_shape)}, expected {list(shape)}")
        want = _SAFETENSORS_DTYPES.get((dtypes or {}).get(name))
        if want and got_dtype != want:
            problems.append(f"tensor {name} is {got_dtype}, expected {want}")
    if problems:
        raise CheckpointError(f"{what} {path} does not match the config: " + "; ".join(problems))
    return files


def name_problems(expected, found) -> list[str]:
    """The missing and the unexpected tensor names of a checkpoint, each listed (none: [])."""
    problems = []
    missing = [n for n in expected if n not in found]
    extra = [n for n in found if n not in expected]
    if missing:
        problems.append(f"missing tensors: {_listing(missing)}")
    if extra:
        problems.append(f"unexpected tensors: {_listing(extra)}")
    return problems


def materialize(model, device) -> dict[str, torch.nn.Parameter]:
    """Allocate every (meta) parameter on `device`, uninitialised; returns the parameters by name."""
    for name, p in list(model.named_parameters()):
        _set_param(model, name, torch.empty(p.shape, dtype=p.dtype, device=device))
    return dict(model.named_parameters())


def by_file(files: dict[str, str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, file in files.items():
        out.setdefault(file, []).append(name)
    return out


@torch.no_grad()
def load_checkpoint(model, path: str, *, device=None) -> None:
    """Fill a meta-device model from a checkpoint folder, after checking every name and shape."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    tensors = checkpoint_tensors(model)
    files = checked_files(path, {n: tuple(t.shape) for n, t in tensors.items()}, stored_dtypes(tensors),
                          f"{model.weights} checkpoint" if model.quant is not None else "checkpoint")
    read_into(materialize(model, device), files, device)
    check_stored_values(model, path)


def check_stored_values(model, path: str) -> None:
    """A CheckpointError naming the tensors of a quantized model (read from `path`) that hold values no
    quantizer writes (`stored_value_problems`); nothing for a BF16 model."""
    problems = stored_value_problems(model) if model.quant is not None else []
    if problems:
        raise CheckpointError(f"{model.weights} checkpoint {path} holds values no quantizer writes: "
                              + _listing(problems, limit=4))


def stored_value_problems(model) -> list[str]:
    """What a quantized model holds that its kernels cannot read as the reference does: E4M3 NaN codes
    (a quantizer saturates at +-448 and never writes them; the kernels place codes by their bits, so they
    would read a finite value where the reference reads NaN) and scales that are not finite. One line per
    tensor, named as the checkpoint names it."""
    if not any(_unreadable(n, p) for n, p in model.named_parameters()):
        return []
    return [f"tensor {n} {why}" for n, t in checkpoint_tensors(model).items() if (why := _unreadable(n, t))]


def _unreadable(name: str, t: torch.Tensor) -> str | None:
    if t.dtype == torch.float8_e4m3fn:
        nan = int(((t.view(torch.uint8) & 0x7F) == 0x7F).sum())
        return f"holds E4M3 NaN codes (0x7F / 0xFF): {nan} of {t.numel()}" if nan else None
    if "scale" in name.rsplit(".", 1)[-1] and t.is_floating_point():
        bad = int((~torch.isfinite(t)).sum())
        return f"holds scales that are not finite: {bad} of {t.numel()}" if bad else None
    return None


@torch.no_grad()
def read_into(params: dict[str, torch.nn.Parameter], files: dict[str, str], device) -> None:
    """Copy every tensor of `files` (name -> file, checked) into its parameter, a file at a time."""
    for file, names in by_file(files).items():
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in names:
                _target(params, name).copy_(f.get_tensor(name))


def stored_dtypes(tensors: dict[str, torch.Tensor]) -> dict[str, torch.dtype]:
    """The dtypes a checkpoint must hold exactly: a quantized projection's codes and scales, which are
    read as they are (every other tensor is cast to the model dtype)."""
    return {n: t.dtype for n, t in tensors.items() if t.dtype in (torch.float8_e4m3fn, torch.uint8)
            or n.endswith((".weight_scale", ".weight_scale_2", ".input_scale"))}


def _target(params: dict[str, torch.nn.Parameter], name: str) -> torch.Tensor:
    m = _PER_EXPERT.match(name)
    if m:
        suffix = next(k for k, v in _SUFFIXES.items() if v == m.group(4))
        return params[f"{m.group(1)}.{m.group(3)}{suffix}"].data[int(m.group(2))]
    return params[name].data


def _listing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")
