"""The variant registry: fusion points, the variants registered on them, and binding a selection.

This is the only part of `workbench` the model imports. A fusion point is declared once, in its
package `workbench/variants/<point>/` (`__init__.py`: the contract, the reference and the spec; one
module per other variant, named after it); the model asks
`bind(selection)` for an `Ops` table and calls `ops.<point>(...)`. Selection is explicit: the
reference unless a lock file or the CLI names another variant, and a named variant that cannot run
here is an error, never a silent fallback. This module must stay free of heavy imports (no
triton, no CLI, no search) because the model imports it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from workbench.compiled import compiled

POINTS = (
    "boundary", "qkvg_proj", "qk_prep", "attention", "attn_out",
    "route", "experts", "dense_mlp", "head", "sample", "attention_out", "draft_attention",
)
# Compound points: fusions across points. The model calls the compound; its reference variant is the
# members' calls in sequence, and where the compound's selection is that reference, binding makes it
# call the members' *selected* variants (the build without a fusion across them). Any other variant
# replaces the members' kernels with its own (their calls then never happen). A compound's variants
# take their members' weights as the reference lays them out (see `Ops`).
COMPOUNDS = {
    "attention_out": ("attention", "attn_out"),
}
_MEMBERS = [m for members in COMPOUNDS.values() for m in members]
assert len(set(_MEMBERS)) == len(_MEMBERS) and set(_MEMBERS) <= set(POINTS) - set(COMPOUNDS), \
    "a compound's members are plain points, each in one compound (the model calls one or the other)"
# Points whose kernels read the KV cache: a decode kernel may load a row's history before its PDL wait, which
# the rows of one verify block, fed as decode rows of one sequence, must not (`without_cache_pdl`)
CACHE_READERS = ("attention",)
# Points only a DFlash drafter's step calls: a lock of the target's own steps never runs them
DRAFTER_POINTS = ("draft_attention",)
BACKENDS = ("torch", "torch_compile", "triton", "flashinfer", "cute")
REFERENCE = "torch"  # every point's reference variant is named after its backend
# The projections' stored formats (beam_model.quant.tensors): every reference reads each of them
# (dequantized, then the model dtype's math); another variant reads those it lists in `formats`.
WEIGHT_FORMATS = ("bf16", "fp8", "nvfp4")


@dataclass
class Variant:
    point: str
    name: str
    backend: str
    fn: Callable
    prepare: Callable[[dict], Any] | None = None  # weight-layout transform, applied at load time
    supports: Callable[..., bool | str] | None = None  # (workload) -> True, or False / the reason it cannot
    configs: list[dict] = field(default_factory=list)  # tuning configs the harness may search
    configure: Callable[[dict], Callable] | None = None  # config -> the variant's callable at that config
    # (config, workload) -> True, or False / why that config does not run as itself at that workload
    config_supports: Callable[..., bool | str] | None = None
    # Its launches honour a config's "pdl" key (programmatic dependent launch, see `tuning_configs`)
    pdl: bool = False
    # The weight formats it reads where its point's weights are quantized (PointSpec.quantized)
    formats: tuple[str, ...] = ("bf16",)
    # The format it quantizes its activations to (e.g. "fp8": per token, dynamic), or None: the reference's
    # weight-only numerics. The gates then hold it to its point's tolerance for that (activation_tolerance).
    activations: str | None = None
    # The file of code that runs in another process (an agent's candidate, called through its sandbox):
    # what the lock keys and names, since `fn` here only forwards the call
    origin: str | None = None

    @property
    def qualname(self) -> str:
        return f"{self.point}:{self.name}"

    @property
    def source_file(self) -> str:
        """The module of the code that computes: for a wrapper (torch_compile), the wrapped function's;
        for a variant run in a sandbox, the file the sandbox loaded."""
        if self.origin:
            return self.origin
        return inspect.getsourcefile(inspect.unwrap(self.fn)) or "?"

    def prepare_weights(self, weights: dict) -> Any:
        return self.prepare(weights) if self.prepare else weights

    def unsupported(self, workload=None, device=None) -> str | None:
        """Why this variant cannot run here, or None when it can: its backend is missing, it needs CUDA
        and `device` is the CPU, or its `supports` predicate declines the workload. `supports` is
        called as `supports(workload)`, or `supports(workload, dtype, device)` when it takes three
        arguments (dtype: the workload's dtype name); it returns True, or False / the reason (str).
        A predicate that raises is reported as the reason, never passed through. The one
        availability rule: the harness, the CLI and the model all ask this."""
        ok, why = backend_available(self.backend)
        if not ok:
            return why
        interpreted = self.backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1"
        if device is not None and str(device).split(":")[0] == "cpu" and self.backend in GPU_BACKENDS \
                and not interpreted:
            return f"backend {self.backend!r} runs on CUDA devices only"
        if workload is None:
            return None
        why = self.unsupported_weights(getattr(workload, "weights", "bf16"))
        if why or self.supports is None:
            return why
        try:
            try:
                n_params = len(inspect.signature(self.supports).parameters)
            except (TypeError, ValueError):
                n_params = 1
            args = (workload, workload.dtype, str(device or "cpu")) if n_params >= 3 else (workload,)
            verdict = self.supports(*args)
        except Exception as e:  # a broken predicate names itself instead of crashing the caller
            return f"{self.qualname}.supports() raised {type(e).__name__}: {e}"
        if verdict is True:
            return None
        return verdict if isinstance(verdict, str) and verdict else \
            f"{self.qualname} does not support {workload.label()}"

    def unsupported_weights(self, fmt: str) -> str | None:
        """Why this variant cannot read its point's weights where a model's are stored as `fmt` (a format
        that leaves this point's projections alone leaves them in BF16), or None."""
        _load(self.point)  # its spec says which formats quantize its weights (a variant made by hand may come first)
        stored = fmt if fmt in _QUANTIZED.get(self.point, ()) else "bf16"
        if stored in self.formats:
            return None
        return f"{self.qualname} reads {'/'.join(self.formats)} weights, not {stored}"

    def unsupported_config(self, config: dict | None, workload) -> str | None:
        """Why tuning config `config` is not worth timing at `workload` (e.g. it would run another
        config's code there), or None."""
        if config is None or self.config_supports is None:
            return None
        verdict = self.config_supports(config, workload)
        if isinstance(verdict, str) or not verdict:
            return verdict or f"{self.qualname} {config} does not run at {workload.label()}"
        return None

    def tuning_configs(self) -> list[dict | None]:
        """The configs a search or bench times (None: the default). Where this GPU can launch kernels
        with programmatic dependent launch (sm_90+), a `pdl` variant's configs come twice, the second
        time with "pdl": True: each kernel then lets the next one launch at once and waits for its
        predecessor's writes in-kernel, hiding the launch gap between small decode kernels. Whether
        that pays depends on the tile (a tile that reads weights before its wait gains most), so it
        is timed per config like any other knob."""
        base = list(self.configs) or [None]
        if not (self.pdl and pdl_available()):
            return base
        return base + [{**(c or {}), "pdl": True} for c in base]

    def at(self, config: dict | None) -> Callable:
        """The callable to run, at a tuning config (a lock file's choice) or the default."""
        if not config:
            return self.fn
        if self.configure is None:
            raise ValueError(f"{self.qualname} takes no tuning config, got {config}")
        return self.configure(config)


_VARIANTS: dict[str, dict[str, Variant]] = {p: {} for p in POINTS}
_QUANTIZED: dict[str, tuple[str, ...]] = {}  # point -> the formats that quantize its weights (its PointSpec's)
_LOADED: set[str] = set()
_SPLITS: dict[str, Callable] = {}  # compound -> split(ops, *args, **kwargs): its members' calls on `ops`


def compound_split(point: str) -> Callable[[Callable], Callable]:
    """Decorator: `split(ops, ...)`, a compound's members called in sequence on an `Ops`-like object
    (attributes named after the members). Its reference is `split` on the members' references."""
    if point not in COMPOUNDS:
        raise KeyError(f"{point!r} is not a compound point; compounds: {', '.join(COMPOUNDS)}")

    def deco(split: Callable) -> Callable:
        _SPLITS[point] = split
        return split

    return deco


def split_of(point: str) -> Callable:
    variants(point)  # imports the compound's module, which declares its split
    if point not in _SPLITS:
        raise RuntimeError(f"workbench/variants/{point}/__init__.py declares no compound_split for {point!r}")
    return _SPLITS[point]


def relaid_members(point: str, selected: dict[str, "Variant"]) -> list["Variant"]:
    """The compound's members whose selected variant re-lays their weights at load time: a fusion of
    the compound, which takes them as the reference lays them out, cannot run beside one."""
    return [selected[m] for m in COMPOUNDS[point] if selected[m].prepare is not None]


class References:
    """Each point's reference callable as an attribute: what a compound's reference calls its members on."""

    def __getattr__(self, point: str) -> Callable:
        if point not in _VARIANTS:
            raise AttributeError(point)
        return reference(point).fn


def quantized_by(point: str, formats: tuple[str, ...]) -> None:
    """Record which weight formats store `point`'s weights quantized (`points.declare` does, from its spec)."""
    unknown = [f for f in formats if f not in WEIGHT_FORMATS[1:]]  # "bf16" is the unquantized format
    if unknown:
        raise ValueError(f"{point}: {unknown} are not quantized weight formats; those are {WEIGHT_FORMATS[1:]}")
    _QUANTIZED[point] = tuple(formats)


def register(point: str, name: str, backend: str, **kw) -> Callable[[Callable], Callable]:
    """Decorator: register `fn` as variant `name` of `point`."""
    if point not in _VARIANTS:
        raise KeyError(f"unknown fusion point {point!r}; points: {', '.join(POINTS)}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; backends: {', '.join(BACKENDS)}")

    def deco(fn: Callable) -> Callable:
        if name in _VARIANTS[point]:
            raise ValueError(f"variant {point}:{name} is registered twice")
        _VARIANTS[point][name] = Variant(point, name, backend, fn, **kw)
        return fn

    return deco


def _load(point: str) -> None:
    if point not in _LOADED:
        importlib.import_module(f"workbench.variants.{point}")  # the contract, reference and spec
        _LOADED.add(point)
        for module in variant_modules(point):
            importlib.import_module(f"workbench.variants.{point}.{module}")
        ref = _VARIANTS[point].get(REFERENCE)
        if ref is None:
            raise RuntimeError(f"workbench/variants/{point}/__init__.py registers no reference variant {REFERENCE!r}")
        ref.formats = WEIGHT_FORMATS
        if "torch_compile" not in _VARIANTS[point]:
            _VARIANTS[point]["torch_compile"] = Variant(point, "torch_compile", "torch_compile", compiled(ref.fn),
                                                        prepare=ref.prepare, formats=WEIGHT_FORMATS)


def variant_modules(point: str) -> list[str]:
    """The modules of a point's package that each register a variant (`<point>/<variant>.py`), sorted."""
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "variants", point)
    return sorted(f[:-3] for f in os.listdir(folder) if f.endswith(".py") and not f.startswith("_"))


def variants(point: str) -> dict[str, Variant]:
    if point not in _VARIANTS:
        raise KeyError(f"unknown fusion point {point!r}; points: {', '.join(POINTS)}")
    _load(point)
    return _VARIANTS[point]


# Variants registered under another name than locks made before the rename give them:
# (point, name in the lock) -> its name now. The code is the same; a lock naming the old one is made again.
RENAMED = {("route", "cublas"): "triton_cublas"}


def get(point: str, name: str) -> Variant:
    table = variants(point)
    if name not in table:
        now = f" (now registered as {RENAMED[point, name]!r})" if (point, name) in RENAMED else ""
        raise KeyError(f"no variant {name!r} for fusion point {point!r}{now}; registered: {', '.join(table)}")
    return table[name]


def reference(point: str) -> Variant:
    return get(point, REFERENCE)


_BACKEND_MODULES = {"triton": "triton", "flashinfer": "flashinfer", "cute": "cutlass"}
GPU_BACKENDS = ("triton", "flashinfer", "cute")


def backend_available(backend: str) -> tuple[bool, str]:
    """Whether a backend can run here (a known name, its library installed, and a GPU where it needs one)."""
    if backend not in BACKENDS:
        return False, f"unknown backend {backend!r}; backends: {', '.join(BACKENDS)}"
    module = _BACKEND_MODULES.get(backend)
    if module is not None and importlib.util.find_spec(module) is None:
        return False, f"backend {backend!r} needs the {module!r} package, which is not installed"
    if module is None or _cuda_available():
        return True, "ok"
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        return True, "ok (Triton interpreter on the CPU)"
    return False, f"backend {backend!r} needs a CUDA GPU" + (" (or TRITON_INTERPRET=1)" if backend == "triton" else "")


def _cuda_available() -> bool:
    import torch  # deferred: the registry must import without torch's start-up cost

    return torch.cuda.is_available()


def pdl_available() -> bool:
    """Whether kernels can be launched with programmatic dependent launch here: a CUDA GPU of sm_90
    or later, and compiled kernels (the Triton interpreter has no grid dependency control)."""
    if os.environ.get("TRITON_INTERPRET") == "1" or not _cuda_available():
        return False
    import torch

    return torch.cuda.get_device_capability() >= (9, 0)


class Ops:
    """A bound selection: one callable per fusion point, resolved once so calls cost nothing extra."""

    def __init__(self, selection: dict[str, str] | None = None, configs: dict[str, dict] | None = None):
        selection, configs = dict(selection or {}), dict(configs or {})
        unknown = sorted((set(selection) | set(configs)) - set(POINTS))
        if unknown:
            raise KeyError(f"selection names unknown fusion points {unknown}; points: {', '.join(POINTS)}")
        self.variants: dict[str, Variant] = {}
        for point in POINTS:
            v = get(point, selection.get(point, REFERENCE))
            ok, why = backend_available(v.backend)
            if not ok:
                raise RuntimeError(f"cannot use {v.qualname}: {why}")
            self.variants[point] = v
            setattr(self, point, v.at(configs.get(point)))
        for point, members in COMPOUNDS.items():
            if self.variants[point].name == REFERENCE:  # no fusion: the members' selected variants run
                setattr(self, point, functools.partial(split_of(point), self))
                continue
            laid_out = relaid_members(point, self.variants)
            if laid_out:  # the model prepares each member's weights with the member's own transform
                raise ValueError(f"{self.variants[point].qualname} takes {'/'.join(members)}'s weights as the "
                                 f"reference lays them out, but {', '.join(v.qualname for v in laid_out)} "
                                 f"re-lays them at load time: select another variant of "
                                 f"{', '.join(v.point for v in laid_out)}")
        self.configs = configs

    @property
    def selection(self) -> dict[str, str]:
        return {p: v.name for p, v in self.variants.items()}

    def prepare(self, point: str, weights: dict) -> Any:
        return self.variants[point].prepare_weights(weights)


def bind(selection: dict[str, str] | None = None, configs: dict[str, dict] | None = None) -> Ops:
    return Ops(selection, configs)


def reads_cache(point: str) -> bool:
    """Whether `point`'s kernels read the KV cache (a compound's do where a member's do)."""
    return point in CACHE_READERS or any(m in CACHE_READERS for m in COMPOUNDS.get(point, ()))


def without_cache_pdl(configs: dict[str, dict] | None) -> dict[str, dict]:
    """`configs` with programmatic dependent launch off at the points that read the KV cache. A decode kernel
    with PDL may load the keys a row takes for history before it waits for the kernel before it (only the
    row's own key comes after): right when each row is a sequence of its own, wrong for the rows of one
    verify block fed as decode rows, whose keys the same step writes. Every other kernel loads only weights
    before its wait, and no step writes those, so it keeps its PDL."""
    return {p: {k: v for k, v in (c or {}).items() if k != "pdl" or not reads_cache(p)}
            for p, c in (configs or {}).items()}


def binds(ops: Ops | None, selection: dict[str, str] | None = None, configs: dict[str, dict] | None = None) -> bool:
    """Whether `ops` is already the build `bind(selection, configs)` would make (same variants, same configs)."""
    selection = selection or {}
    return ops is not None and ops.configs == dict(configs or {}) and \
        ops.selection == {p: selection.get(p, REFERENCE) for p in POINTS}
