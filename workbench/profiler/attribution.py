"""Attribute one profiled step's kernels (or, on CPU, its ATen ops) to fusion points and layers."""

from __future__ import annotations

import os
import statistics
import tempfile
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, fields

import torch
from torch.profiler import ProfilerActivity

from workbench.profiler.idle import device_idle
from workbench.profiler.quiet import profiling
from workbench.profiler.ranges import LAYER_RANGE, POINT_RANGE, instrument
from workbench.profiler.trace import device_work, layer_kind, load
from workbench.registry import COMPOUNDS


@dataclass
class PointProfile:
    point: str
    variant: str
    calls: int
    calls_by_kind: dict[str, int]  # "sliding"/"full" layer, or "model" for once-per-step points
    time_us: float        # device time per step (CPU time on a CPU-only machine)
    share: float          # of the attributed step time
    kernels: int          # launches per step
    floor_us: float | None = None  # roofline floor of all its calls in one step
    top_kernels: list[tuple[str, int, float]] = field(default_factory=list)  # name, count, us

    @property
    def headroom(self) -> float | None:
        return self.time_us / self.floor_us if self.floor_us else None


@dataclass
class Profile:
    target: str
    preset: str | None
    dtype: str
    device: str
    time_unit: str                  # "device" (GPU kernel time) or "cpu"
    total_us: float                 # all attributed time in the step
    unattributed_us: float          # kernels outside any fusion point (embedding, indexing)
    kernels_per_step: int
    kernels_per_layer: dict[str, float]  # median launches per layer, by layer kind
    points: list[PointProfile]
    trace: str | None = None
    idle: dict | None = None  # device idle in the step and what opened it (`idle.device_idle`); None on a CPU

    def to_dict(self) -> dict:
        d = asdict(self)
        for p, src in zip(d["points"], self.points):
            p["headroom"] = src.headroom
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        """A saved `profile.json` back as a Profile (what `to_dict` wrote; `headroom` is recomputed, and
        keys a writer added beside the profile, such as optimize's `key`, are ignored)."""
        points = [PointProfile(**{**{k: v for k, v in p.items() if k != "headroom"},
                                  "top_kernels": [tuple(k) for k in p.get("top_kernels", [])]})
                  for p in d["points"]]
        names = {f.name for f in fields(cls)}
        return cls(**{**{k: v for k, v in d.items() if k in names}, "points": points})


def _walk(evt):
    yield evt
    for child in evt.cpu_children:
        yield from _walk(child)


# ATen ops that only make views or allocate: not kernels when the CPU stands in for a device.
_NO_WORK = {"aten::view", "aten::as_strided", "aten::reshape", "aten::expand", "aten::select", "aten::slice",
            "aten::unsqueeze", "aten::squeeze", "aten::resolve_conj", "aten::resolve_neg", "aten::t",
            "aten::transpose", "aten::permute", "aten::empty", "aten::empty_like", "aten::empty_strided",
            "aten::alias", "aten::detach", "aten::lift_fresh", "aten::_unsafe_view", "aten::unbind"}


# torch.compile's generated CPU kernels run under this range with no ATen op of their own.
_COMPILED_GRAPH = "## Call CompiledFxGraph"
_COMPILED_KERNELS = "torch.compile kernels"


def _cpu_work(evt) -> list[tuple[str, float]]:
    """(name, us) of the leaf ATen ops that compute under a range, and of each compiled graph's own
    kernels (its time outside those ops): the CPU stands in for a device."""
    def computes(e):
        return e.name.startswith("aten::") and e.name not in _NO_WORK

    def leaves(root):  # the innermost computing ops (aten::mm counts though it calls aten::resolve_conj)
        return [(e.name, e.cpu_time_total) for e in _walk(root)
                if computes(e) and not any(computes(d) for c in e.cpu_children for d in _walk(c))]

    compiled = [(_COMPILED_KERNELS, e.cpu_time_total - sum(t for _, t in leaves(e)))
                for e in _walk(evt) if e.name.startswith(_COMPILED_GRAPH)]
    return leaves(evt) + compiled


def _tally(work: list[tuple[str, float]]) -> tuple[Counter, Counter]:
    """Launches and time per kernel name."""
    launches, times = Counter(), Counter()
    for name, us in work:
        launches[name] += 1
        times[name] += us
    return launches, times


def _trace_events(prof, trace_path: str | None) -> list[dict]:
    if trace_path:
        return load(trace_path)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        return load(path)


def summarize(events: list[dict], config) -> dict:
    """A saved trace's kernels per layer (median by layer kind), kernels / device us per fusion point, and
    device idle; `config` is the model the trace was taken on."""
    ranges, all_work = device_work(events)
    per_layer, per_point = defaultdict(list), defaultdict(list)
    for name, work in ranges:
        if name.startswith(LAYER_RANGE):
            per_layer[layer_kind(config, int(name[len(LAYER_RANGE):]))].append(len(work))
        else:
            per_point[name[len(POINT_RANGE):]].extend(work)
    return {"kernels_per_step": len(all_work), "device_us": sum(us for _, us in all_work),
            "idle": device_idle(events),
            "kernels_per_layer": {k: statistics.median(v) for k, v in sorted(per_layer.items())},
            "points": {p: {"kernels": len(w), "us": sum(us for _, us in w)} for p, w in sorted(per_point.items())}}


def profile_step(runner, *, workload_for=None, ceilings=None, trace_path: str | None = None) -> Profile:
    """Profile one eager step of a `StepRunner`. `workload_for(layer_kind)` gives the Workload of a
    call in that kind of layer, used with `ceilings` for each point's roofline floor."""
    model = runner.model
    on_device = model.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    # in inference mode, as the runner's timed steps run: a workspace a variant made in one of those
    # is an inference tensor, which a step outside it may not write
    with instrument(model) as log, torch.inference_mode():
        runner._eager()  # warm-up: lazy compilation and autotuning stay out of the profile
        if on_device:
            torch.cuda.synchronize()
        log.calls.clear()
        with profiling(activities) as prof:
            runner._eager()
            if on_device:
                torch.cuda.synchronize()
    if trace_path:
        prof.export_chrome_trace(trace_path)

    per_point: dict[str, list[tuple[str, float]]] = {}
    per_layer: dict[str, list[int]] = {}
    idle = None
    if on_device:  # from the trace: Triton's driver-API launches are missing from the op tree
        events = _trace_events(prof, trace_path)
        ranges, all_work = device_work(events)
        idle = device_idle(events)
    else:
        ranges = [(e.name, _cpu_work(e)) for e in prof.events() if e.name.startswith((POINT_RANGE, LAYER_RANGE))]
        all_work = [w for e in prof.events() if e.cpu_parent is None for w in _cpu_work(e)]
    for name, work in ranges:
        if name.startswith(POINT_RANGE):
            per_point.setdefault(name[len(POINT_RANGE):], []).extend(work)
        else:
            per_layer.setdefault(layer_kind(model.config, int(name[len(LAYER_RANGE):])), []).append(len(work))
    attributed = 0.0
    total = sum(us for _, us in all_work)
    points = []
    def calls_of(point):
        return {kind: n for (p, kind), n in log.calls.items() if p == point}

    def floor_of(point, by_kind):
        if not (workload_for and ceilings):
            return None
        from workbench.points import spec
        from workbench.roofline import floor_us

        return sum(n * floor_us(spec(point), workload_for(kind), ceilings) for kind, n in by_kind.items())

    for point, work in per_point.items():
        us = sum(t for _, t in work)
        attributed += us
        counts, times = _tally(work)
        by_kind = calls_of(point)
        top = sorted(((n, counts[n], times[n]) for n in counts), key=lambda r: -r[2])[:5]
        points.append(PointProfile(point, model.ops.variants[point].name, sum(by_kind.values()), by_kind, us,
                                   us / total if total else 0.0, len(work), floor_of(point, by_kind), top))
    for point in COMPOUNDS:  # called, running its members' kernels (in their ranges): none of its own,
        by_kind = calls_of(point)  # and no floor of its own (the members' count in the step's)
        if by_kind and point not in per_point:
            points.append(PointProfile(point, model.ops.variants[point].name, sum(by_kind.values()), by_kind, 0.0,
                                       0.0, 0, None, []))
    points.sort(key=lambda p: -p.time_us)
    c = model.config
    return Profile(
        target=runner.target.name, preset=c.preset, dtype=str(model.dtype).replace("torch.", ""),
        device=torch.cuda.get_device_name(model.device) if on_device else "cpu",
        time_unit="device" if on_device else "cpu", total_us=total, unattributed_us=total - attributed,
        kernels_per_step=len(all_work),
        kernels_per_layer={k: statistics.median(v) for k, v in sorted(per_layer.items())},
        points=points, trace=trace_path, idle=idle)


def kernels_per_call(fn, device, calls: int = 5) -> list[dict]:
    """The kernels one call of `fn()` launches (ATen ops standing in on a CPU), by device time:
    [{"kernel", "launches", "us"}] per call, averaged over `calls` profiled calls after one warm-up
    (compilation and autotuning stay out). What `workbench bench --kernels` lists for each variant.
    In inference mode, as the bench's timed calls run (see `profile_step`)."""
    on_device = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    with torch.inference_mode():
        fn()
        if on_device:
            torch.cuda.synchronize()
        with profiling(activities) as prof:
            for _ in range(calls):
                fn()
            if on_device:
                torch.cuda.synchronize()
    if on_device:  # from the trace: Triton's driver-API launches are missing from the op tree
        work = device_work(_trace_events(prof, None))[1]
    else:
        work = [w for e in prof.events() if e.cpu_parent is None for w in _cpu_work(e)]
    launches, times = _tally(work)
    return [{"kernel": name, "launches": launches[name] / calls, "us": times[name] / calls}
            for name in sorted(times, key=lambda n: -times[n])]
