"""Per-op timing harness: time variants of a fusion point, put them against the roofline, write results.

What it does: `time_call` times one callable on rotating copies of its inputs and weights (CUDA
events on a GPU, `perf_counter_ns` on the CPU), optionally replaying CUDA graphs of several calls on
rotating copies, as the server runs decode; `bench_point` times a point's variants (reference always included, same run)
at one `Workload` and returns bench.json rows; `measure_device_ceilings` / `floor_us` give the
roofline floor; `environment` / `write_results` leave the machine-readable record of a run.

What it must never do: compute a metric from anything but the point's `PointSpec` (inputs, bytes,
FLOPs come from the spec, never from a variant); let one failing variant abort a bench (it gets an
error row); report a speed-up that is not a ratio of two timings from the same run; time on zeros
(inputs come from `make_inputs` with a seed); import the CLI or the TUI.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import inspect
import json
import math
import os
import platform
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from workbench import registry
from workbench.gates import op_gate
from workbench.points import Call, Workload, leaves, map_leaves, spec
from workbench.quarantine import quarantined

# Names this process in the timings it makes: a resumed run keeps earlier processes' timings, and only
# timings of one process make a ratio (another process, or another start of the GPU host, runs the same
# build at another speed).
PROCESS_ID = uuid.uuid4().hex[:12]

ROW_FIELDS = ("point", "variant", "backend", "shape", "batch", "dtype", "median_us", "p10_us", "p90_us",
              "floor_us", "speedup_vs_reference")  # the design doc's bench.json schema; rows add more
CPU_ROTATE_BYTES = 64 << 20  # no portable way to read the CPU's last-level cache size; 64 MiB covers most
GRAPH_CALLS = 16             # calls captured back to back in one timed graph replay
GUARD_CYCLES = 100_000       # ~50 us of GPU spin before each timed rep (see _Timer.guard)


@dataclass
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    spread: float                  # (p90 - p10) / median
    reps: int
    copies: int                    # rotated input/weight sets cycled through
    copy_bytes: int                # bytes allocated by one set
    touched_bytes: int             # bytes one call reads/writes (what rotation must push out of L2)
    graph: bool                    # replayed CUDA graphs (False: eager calls)
    graph_error: str | None = None  # why graph capture was asked for but not used
    l2_flush: bool = False         # copies alone could not exceed the cache: L2 flushed between reps
    fresh_copies: int = 0          # copies from make_call; the rest are clones of them
    recompiles: int = 0            # torch.compile graphs made while samples were taken: not a valid timing
    # Wall time of the first call, synchronized: JIT builds, compiles, autotuning and lazy inits in this
    # process (small when an earlier call or an on-disk cache already paid them). Never in median_us.
    first_call_ms: float | None = None
    samples_us: list[float] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("samples_us")
        return d


# ---- a call's memory ------------------------------------------------------------------------------

def call_bytes(call: Call) -> int:
    """Bytes allocated by a call's tensors, each storage counted once (views share storage)."""
    storages = {}
    for t in leaves(call):
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            storages[(s.device, s.data_ptr())] = s.nbytes()
    return sum(storages.values())


def clone_call(call: Call) -> Call:
    """The same call on fresh memory (same values): a rotated copy without running make_inputs again.
    Generators stay shared: a sampling call's own generator must advance across calls."""
    return map_leaves(call, lambda t: t.clone())


def invoke(fn: Callable, call: Call):
    return fn(*call.args, **call.kwargs)


# ---- statistics ------------------------------------------------------------------------------------

def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not sorted_values:
        raise ValueError("no samples")
    pos = (len(sorted_values) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(samples_us: list[float]) -> tuple[float, float, float, float]:
    s = sorted(samples_us)
    med, p10, p90 = percentile(s, 50), percentile(s, 10), percentile(s, 90)
    return med, p10, p90, (p90 - p10) / med if med > 0 else math.inf


# ---- timing ----------------------------------------------------------------------------------------

def _device(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def l2_bytes(device) -> int | None:
    device = _device(device)
    if device.type != "cuda":
        return None
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", None) or None


def default_rotate_bytes(device) -> int:
    """Twice the L2 on a GPU (120 MB on an H200), so no copy is still cached when its turn comes."""
    return 2 * (l2_bytes(device) or 32 << 20) if _device(device).type == "cuda" else CPU_ROTATE_BYTES


def _memory_budget(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2  # leave room for outputs, graphs and the next variant's prepared weights
    return 2 << 30


def _capture_graphs(fn, groups, device):
    """One CUDA graph per group of rotated copies (the calls back to back, as inside a model step),
    sharing one memory pool; outputs kept alive so no graph's output memory is handed to another.
    Returns (graphs, outputs) or raises."""
    side = torch.cuda.Stream(device)  # capture cannot run on the legacy default stream
    side.wait_stream(torch.cuda.current_stream(device))
    pool = torch.cuda.graph_pool_handle()
    graphs, outputs = [], []
    with torch.cuda.stream(side):
        for _ in range(2):  # lazy inits (cuBLAS handles, compilation, autotuning) must precede capture
            invoke(fn, groups[0][0])
        for group in groups:  # and every call once: host-side plans (FlashInfer's) are per call's metadata
            for call in group:
                invoke(fn, call)
        side.synchronize()
        # capture_begin/end rather than `torch.cuda.graph`, which synchronizes and empties the
        # allocator's cache on every entry: too slow for hundreds of small captures.
        for group in groups:
            g = torch.cuda.CUDAGraph()
            gens = {id(x): x for call in group for x in leaves(call)
                    if isinstance(x, torch.Generator) and x.device.type == "cuda"}
            for gen in gens.values():  # a sampling call's own generator must advance on every replay
                g.register_generator_state(gen)
            g.capture_begin(pool=pool)
            try:
                outputs.extend(invoke(fn, call) for call in group)
            finally:
                g.capture_end()
            graphs.append(g)
    torch.cuda.current_stream(device).wait_stream(side)
    return graphs, outputs


def _describe(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    if e.__context__ is not None and e.__context__ is not e:  # capture_end's error hides the cause
        msg += f" (during: {_describe(e.__context__)})"
    return msg[:500]


class _Timer:
    """Times reps of `step(k)`; CUDA events per rep on a GPU, host clock on the CPU."""

    def __init__(self, device: torch.device, flush_bytes: int):
        self.device = device
        self.cuda = device.type == "cuda"
        self.flush = None
        if self.cuda and flush_bytes:
            self.flush = torch.ones(flush_bytes // 4, dtype=torch.float32, device=device)

    def guard(self):
        # Runs before each rep's start event, outside the timed window. Flushing the L2 (when copies
        # alone cannot exceed it) or spinning keeps the GPU busy while the host enqueues the start
        # event, the call and the end event, so a rep measures device time, not the host's launch gap.
        # The flush reads rather than writes: lines left dirty would be written back during the
        # timed call and bill it for bandwidth it does not use.
        if self.flush is not None:
            self.flush.sum()
        elif hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(GUARD_CYCLES)

    def run(self, step: Callable[[int], Any], first: int, n: int, copies: int) -> list[float]:
        if not self.cuda:
            out = []
            for j in range(n):
                t0 = time.perf_counter_ns()
                step((first + j) % copies)
                out.append((time.perf_counter_ns() - t0) / 1e3)
            return out
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for j, (start, end) in enumerate(events):
            self.guard()
            start.record()
            step((first + j) % copies)
            end.record()
        torch.cuda.synchronize(self.device)
        return [start.elapsed_time(end) * 1e3 for start, end in events]  # ms -> us


def time_call(fn: Callable, make_call: Callable[[int], Call], *, device="cpu", warmup: int = 10,
              min_reps: int = 50, max_reps: int = 2000, target_spread: float = 0.05,
              rotate_bytes: int | None = None, use_graph: bool | None = None, touched_bytes: int | None = None,
              max_copies: int = 256, max_seconds: float = 2.0, make_seconds: float = 2.0) -> Timing:
    """Time `fn(*call.args, **call.kwargs)` over rotated copies `make_call(0..copies-1)`.

    Copies: enough that copies * touched_bytes >= rotate_bytes (default 2x L2), at most `max_copies`
    and half the free memory; if that falls short, the L2 is flushed before each rep. Copies come
    from `make_call(i)` while that takes under `make_seconds` in all, then as clones of those (some
    points build a whole paged KV cache per call). Reps run in rounds until the spread
    (p90-p10)/median <= target_spread (after min_reps), max_reps, or max_seconds of timing.
    use_graph (default: on CUDA) captures the calls GRAPH_CALLS at a time per CUDA graph (back to back,
    as in a model step) and reports replay time / GRAPH_CALLS; a failed capture
    falls back to eager calls with the reason in `graph_error`.
    """
    device = _device(device)
    cuda = device.type == "cuda"
    use_graph = cuda if use_graph is None else use_graph
    rotate_bytes = default_rotate_bytes(device) if rotate_bytes is None else rotate_bytes
    max_reps = max(max_reps, 1)
    with torch.inference_mode():
        calls, fresh = [make_call(0)], 1
        copy_bytes = max(call_bytes(calls[0]), 1)
        touched = max(touched_bytes or copy_bytes, 1)
        want = max(1, math.ceil(rotate_bytes / touched))
        copies = max(1, min(want, max_copies, _memory_budget(device) // copy_bytes))
        started = time.perf_counter()
        for i in range(1, copies):
            if fresh == i and time.perf_counter() - started < make_seconds:
                calls.append(make_call(i))
                fresh += 1
            else:
                calls.append(clone_call(calls[i % fresh]))
        flush = cuda and copies * touched < rotate_bytes
        timer = _Timer(device, rotate_bytes if flush else 0)
        first_call_ms = _first_call_ms(fn, calls[0], device)

        graph_error = None
        step = lambda k: invoke(fn, calls[k])  # noqa: E731
        per_rep, steps = 1, copies
        if use_graph and not cuda:
            use_graph, graph_error = False, "CUDA graphs need a CUDA device"
        if use_graph:
            try:
                # Several calls per graph: one replay's launch latency, amortised, is not the op's cost.
                per_rep = min(GRAPH_CALLS, copies)
                groups = [calls[i:i + per_rep] for i in range(0, copies - per_rep + 1, per_rep)]
                graphs, _outputs = _capture_graphs(fn, groups, device)
                step, steps = (lambda k: graphs[k].replay()), len(graphs)  # noqa: E731
            except Exception as e:  # any capture failure (host sync, unsupported op): time eagerly
                graph_error = _describe(e)
                use_graph, per_rep, steps = False, 1, copies
                try:
                    torch.cuda.synchronize(device)
                except Exception:
                    pass

        timer.run(step, 0, max(warmup, 1), steps)  # compilation, autotuning, lazy inits
        done, started = max(warmup, 1), time.perf_counter()
        while done < steps and time.perf_counter() - started < max_seconds:
            timer.run(step, done, min(32, steps - done), steps)  # first touch / graph upload of each copy
            done += 32
        samples: list[float] = []
        started = time.perf_counter()
        batch = max(1, min_reps)
        compiled_before = _compiled_graphs()
        while True:
            samples += [t / per_rep for t in timer.run(step, len(samples), min(batch, max_reps - len(samples)), steps)]
            med, p10, p90, spread = summarize(samples)
            if len(samples) >= min_reps and spread <= target_spread:
                break
            if len(samples) >= max_reps or time.perf_counter() - started > max_seconds:
                break
            batch = len(samples)  # double the sample each round
    return Timing(med, p10, p90, spread, len(samples), copies, copy_bytes, touched, use_graph, graph_error,
                  flush, fresh, _compiled_graphs() - compiled_before, first_call_ms, samples)


def _first_call_ms(fn, call, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    invoke(fn, call)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 1e3 * (time.perf_counter() - started)


def _compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far (0 where dynamo is unavailable)."""
    try:
        from torch._dynamo.utils import counters
    except Exception:  # noqa: BLE001 - a torch without dynamo has nothing to count
        return 0
    return int(counters["stats"]["unique_graphs"])


def relative_difference(a, b) -> float:
    """|a - b| / min(a, b) of two medians (Timing or microseconds)."""
    a, b = (x.median_us if isinstance(x, Timing) else float(x) for x in (a, b))
    return abs(a - b) / min(a, b)


def noise_band(fn: Callable, make_call: Callable[[int], Call], **timing_kw) -> float:
    """The incumbent timed twice, independently: the relative difference of the two medians."""
    return relative_difference(time_call(fn, make_call, **timing_kw), time_call(fn, make_call, **timing_kw))


def compare(candidate, incumbent, band: float) -> bool:
    """True only if the candidate is faster than the incumbent by more than the noise band."""
    c, i = (x.median_us if isinstance(x, Timing) else float(x) for x in (candidate, incumbent))
    return (i - c) / i > band


# ---- roofline ----------------------------------------------------------------------------------------

def cache_dir() -> Path:
    return Path(os.environ.get("BEAM_WORKBENCH_CACHE") or Path.home() / ".cache" / "beam-workbench")


def device_name(device) -> str:
    device = _device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu {platform.processor() or platform.machine()} x{os.cpu_count()}"


def _median_time_s(fn: Callable[[], Any], device: torch.device, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return percentile(sorted(times), 50)


def _measure(device: torch.device) -> dict:
    cuda = device.type == "cuda"
    # Random data, never zeros: a matrix product ran 13% faster on zeros on an H200 here.
    n_copy = (1 << 30) if cuda else (32 << 20)  # elements of bf16: 2 GiB (GPU) / 64 MiB (CPU) each way
    src = torch.randn(n_copy, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    t_copy = _median_time_s(functools.partial(dst.copy_, src), device, 3, 10)
    del src, dst
    n = 8192 if cuda else 512
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    t_mm = _median_time_s(lambda: a @ b, device, 3, 10)
    return {"bandwidth_Bps": 2 * n_copy * 2 / t_copy, "matmul_flops": 2 * n ** 3 / t_mm}


def measure_device_ceilings(device, *, refresh: bool = False) -> dict:
    """{"bandwidth_Bps", "matmul_flops"} of `device`: a device-to-device copy (bytes read + written)
    and a bf16 matrix product on random data, measured once and cached per device name in
    `$BEAM_WORKBENCH_CACHE/ceilings.json` (default ~/.cache/beam-workbench/ceilings.json)."""
    device = _device(device)
    path = cache_dir() / "ceilings.json"
    name = device_name(device)
    cache = {}
    if path.exists():
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            cache = {}  # a corrupt cache is re-measured, not fatal
    if not refresh and name in cache:
        return {k: float(cache[name][k]) for k in ("bandwidth_Bps", "matmul_flops")}
    with torch.inference_mode():
        ceilings = _measure(device)
    cache[name] = {**ceilings, "measured_at": _now(), "torch": torch.__version__}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(cache, indent=2))
    tmp.replace(path)  # atomic: concurrent benches never read half a file
    return ceilings


def floor_us(point_spec, workload: Workload, ceilings: dict) -> float:
    """Roofline floor of one call: max(bytes / bandwidth, flops / matmul rate), in microseconds."""
    return 1e6 * max(point_spec.bytes(workload) / ceilings["bandwidth_Bps"],
                     point_spec.flops(workload) / ceilings["matmul_flops"])


# ---- benching a point ----------------------------------------------------------------------------------

def availability(variant: registry.Variant, workload: Workload | None = None, device=None) -> tuple[bool, str]:
    """Whether a variant can run here: its backend (library, GPU), then its `supports` predicate if it
    has one. `supports` is called as `supports(workload)`, or `supports(workload, dtype, device)` when
    it takes three arguments (the design doc's form; dtype is the workload's dtype name); it returns
    True, or False / a string saying why not."""
    ok, why = registry.backend_available(variant.backend)
    if not ok or variant.supports is None or workload is None:
        return ok, why
    try:
        try:
            n_params = len(inspect.signature(variant.supports).parameters)
        except (TypeError, ValueError):
            n_params = 1
        args = (workload, workload.dtype, _device(device or "cpu")) if n_params >= 3 else (workload,)
        verdict = variant.supports(*args)
    except Exception as e:
        return False, f"{variant.qualname}.supports() raised {_describe(e)}"
    if verdict is True:
        return True, "ok"
    return False, verdict if isinstance(verdict, str) and verdict else \
        f"{variant.qualname}.supports() is false for {workload.label()} on {device}"


def _with_prepared_weights(variant: registry.Variant, call: Call) -> Call:
    """`call` with its weights in the variant's layout (`prepare`), as the model would hold them."""
    if call.weights_arg is None:
        return call
    return call.with_weights(variant.prepare_weights(call.args[call.weights_arg]))


def _timed_variant(variant: registry.Variant, base_call: Callable[[int], Call], *, device, config=None,
                   touched_bytes=None, **timing_kw) -> Timing:
    prepared: dict[int, Call] = {}

    def make_call(i: int) -> Call:
        if i not in prepared:  # the weight-layout transform runs once per copy, outside the timing
            prepared[i] = _with_prepared_weights(variant, base_call(i))
        return prepared[i]

    try:
        return time_call(variant.at(config), make_call, device=device, touched_bytes=touched_bytes, **timing_kw)
    finally:
        prepared.clear()
        if _device(device).type == "cuda":
            torch.cuda.empty_cache()


def time_variant(variant: registry.Variant, workload: Workload, *, device="cpu", config: dict | None = None,
                 seed: int = 0, **timing_kw) -> dict:
    """One variant (at a tuning config) at one workload, inputs from its point's spec: Timing.as_dict()."""
    point_spec = spec(variant.point)
    return _timed_variant(variant, lambda i: point_spec.make_inputs(workload, _device(device), seed + i),
                          device=device, config=config, touched_bytes=int(point_spec.bytes(workload)),
                          **timing_kw).as_dict()


def time_fn(fn: Callable[[], Any], *, device="cpu", budget_s: float = 2.0, **timing_kw) -> dict:
    """A no-argument callable that brings its own data and graph (a whole target step): no rotation.
    A slow step (a prefill of thousands of tokens takes 0.1-4 s) gets fewer warm-up calls and samples
    (`reps_for` within `budget_s`), so an end-to-end stage times its ~a dozen builds in minutes, not an hour."""
    device = _device(device)
    _first_call_ms(lambda: fn(), Call(()), device)  # compiles, lazy inits: not the step's time
    seconds = _first_call_ms(lambda: fn(), Call(()), device) / 1e3
    reps = reps_for(seconds, budget_s)
    reps["warmup"] -= 2  # the two calls above warmed it up too (time_call makes at least one more)
    timing_kw = {"use_graph": False, "rotate_bytes": 0, **reps, **timing_kw}
    return time_call(lambda: fn(), lambda i: Call(()), device=device, **timing_kw).as_dict()


def reps_for(seconds_per_call: float, budget_s: float = 2.0) -> dict:
    """Warm-up calls and minimum samples for a callable that takes `seconds_per_call`: the defaults
    (10, 50) while 50 samples fit in `budget_s`, else 2 warm-ups and as many samples as fit in the
    budget, but at least 5 (a median of 5 whole steps; their spread is reported beside it)."""
    if seconds_per_call * 50 <= budget_s:
        return {"warmup": 10, "min_reps": 50}
    return {"warmup": 2, "min_reps": max(5, int(budget_s / seconds_per_call))}


def _row(point, variant, backend, workload, device) -> dict:
    row = dict.fromkeys(ROW_FIELDS)
    row.update(point=point, variant=variant, backend=backend, shape=workload.label(), batch=workload.batch,
               dtype=workload.dtype, preset=workload.preset, device=str(device), pct_of_floor=None,
               spread=None, reps=None, copies=None, graph=None, graph_error=None, l2_flush=None, error=None)
    return row


def bench_point(point: str, variant_names: list[str] | None = None, workload: Workload | None = None, *,
                device="cpu", seed: int = 0, ceilings: dict | None = None, configs: str | list[dict] | None = None,
                gate: bool = False, kernels: bool = False,
                on_progress: Callable[[str, int, int], None] | None = None, **timing_kw) -> list[dict]:
    """Time `variant_names` (default: all registered) of `point` at `workload`; the reference is always
    timed, first, in the same run. Returns one bench.json row per variant and config; a variant that
    is unavailable, raises or (with `gate`) fails the op gate gets a row with `error` and no timings.
    `configs`: None times each variant at its default; "all" at every registered tuning config; a
    list of config dicts at those (a tuner's own, no source edit). `kernels`: each timed row also lists
    the kernels one call launches, by device time (`row["kernels"]`, or `row["kernels_error"]`).
    `timing_kw` go to `time_call`."""
    device = _device(device)
    workload = workload or Workload()
    point_spec = spec(point)
    table = registry.variants(point)
    names = list(dict.fromkeys([registry.REFERENCE, *(variant_names or table)]))
    variants = [registry.get(point, n) for n in names]  # an unknown name is the caller's mistake: raise
    skipped = {} if variant_names else {n: quarantined(point, n, device) for n in names}  # named: tried
    runs = [(v, config) for v in variants for config in _configs_of(v, configs)]

    touched = floor = None
    try:
        touched = int(point_spec.bytes(workload))
        floor = floor_us(point_spec, workload, ceilings or measure_device_ceilings(device))
    except Exception:
        pass  # a spec without bytes/flops still times; the floor stays empty

    base: dict[int, Call] = {}  # every variant gets the same inputs: copy i is seed + i

    def base_call(i: int) -> Call:
        if i not in base:
            base[i] = point_spec.make_inputs(workload, device, seed + i)
        return base[i]

    rows = []
    for idx, (v, config) in enumerate(runs):
        if on_progress:
            on_progress(v.name, idx, len(runs))
        row = _row(point, v.name, v.backend, workload, device)
        row["config"] = config
        rows.append(row)
        ok, why = availability(v, workload, device)
        row["error"] = f"unavailable: {why}" if not ok else skipped.get(v.name)
        if config and v.configure is None:
            row["error"] = f"{v.qualname} takes no tuning config"
        elif ok and not row["error"]:
            why_not = v.unsupported_config(config, workload)
            row["error"] = why_not and f"skipped: {why_not}"
        if row["error"]:
            continue
        try:
            if gate and v.name != registry.REFERENCE:
                report = op_gate(v, [workload], device=device, seeds=(seed,), config=config)
                row["gate"] = "pass" if report.passed else report.first_failure()
                if not report.passed:
                    row["error"] = f"fails the op gate: {row['gate']}"
                    continue
            t = _timed_variant(v, base_call, device=device, config=config, touched_bytes=touched, **timing_kw)
        except Exception as e:  # one variant's failure is its row, never the whole bench
            row["error"] = _describe(e)
            continue
        row.update(median_us=t.median_us, p10_us=t.p10_us, p90_us=t.p90_us, spread=t.spread, reps=t.reps,
                   copies=t.copies, graph=t.graph, graph_error=t.graph_error, l2_flush=t.l2_flush,
                   first_call_ms=t.first_call_ms)
        if kernels:
            _list_kernels(row, v, config, base_call(0), device)
    ref_us = rows[0]["median_us"]
    for row in rows:
        row["floor_us"] = floor
        if floor and row["median_us"]:
            row["pct_of_floor"] = 100 * floor / row["median_us"]
        if ref_us and row["median_us"]:
            row["speedup_vs_reference"] = ref_us / row["median_us"]
    return rows


def _list_kernels(row: dict, v: registry.Variant, config, call: Call, device) -> None:
    """row["kernels"]: what one eager call of the variant launches (a profiler failure is noted, the
    timing stands)."""
    from workbench.profiler import kernels_per_call

    call, fn = _with_prepared_weights(v, call), v.at(config)
    try:
        row["kernels"] = kernels_per_call(lambda: invoke(fn, call), device)
    except Exception as e:
        row["kernels_error"] = _describe(e)


def top_kernels(kernels: list[dict], top: int = 10) -> list[tuple[str, str, str]]:
    """(kernel, launches, us) cells of the `top` kernels by time, then one row summing the rest; C++
    kernel names shortened (bench.json keeps them whole)."""
    from workbench.profiler.trace import short_name

    rest = kernels[top:]
    rows = [(short_name(k["kernel"]), k["launches"], k["us"]) for k in kernels[:top]]
    if rest:
        rows.append((f"{len(rest)} more", sum(k["launches"] for k in rest), sum(k["us"] for k in rest)))
    return [(name, f"{launches:g}", f"{us:.2f}") for name, launches, us in rows]


def kernels_table(rows: list[dict]) -> str:
    """Markdown: each row's kernels per call (from `bench --kernels`)."""
    lines = []
    for r in rows:
        if r.get("kernels") is None and not r.get("kernels_error"):
            continue
        label = r["variant"] + (f" `{config_text(r['config'])}`" if r.get("config") else "")
        lines += ["", f"### {label}", ""]
        if r.get("kernels_error"):
            lines.append(f"kernels not listed: {r['kernels_error']}")
            continue
        lines += ["| kernel | launches per call | us per call |", "|---|---:|---:|"]
        lines += [f"| `{name[:120]}` | {launches} | {us} |" for name, launches, us in top_kernels(r["kernels"])]
    return "\n".join(lines)


def config_text(config: dict) -> str:
    """A tuning config on one line, as a row names it."""
    return json.dumps(config, separators=(",", ":"))


def _configs_of(v: registry.Variant, configs: str | list[dict] | None) -> list[dict | None]:
    """The configs a bench times `v` at: the reference and config-less variants at their default."""
    if configs is None or v.name == registry.REFERENCE:
        return [None]
    return v.tuning_configs() if configs == "all" else list(configs)


# ---- result files -----------------------------------------------------------------------------------------

def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], *, cwd: Path = ROOT, env: dict | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=cwd, env=env)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def git_tree(cwd: Path = ROOT) -> str | None:
    """The git tree hash of the files as they are on disk (ignored files left out), built in a
    throwaway index: `git rev-parse COMMIT^{tree}` for a clean checkout of COMMIT. It names the code a
    result ran where `git_commit` cannot: the GPU host's copy of the tree carries a .git older than its
    files, so there the commit is stale and only "dirty" says so."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "GIT_INDEX_FILE": os.path.join(d, "index")}
        for step in (["read-tree", "HEAD"], ["add", "-A"]):
            if _run(["git", "--no-optional-locks", *step], cwd=cwd, env=env) is None:
                return None
        return _run(["git", "--no-optional-locks", "write-tree"], cwd=cwd, env=env)


def _version(dist: str, module: str) -> str | None:
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec(module) is None:
        return None
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "present"


def environment(device=None) -> dict:
    """What a result depends on: GPU, driver, library versions, git commit and tree, host, date."""
    cuda = torch.cuda.is_available()
    gpu = _device(device if device is not None and torch.device(device).type == "cuda" else "cuda") if cuda else None
    smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    commit = _run(["git", "--no-optional-locks", "rev-parse", "HEAD"])
    status = _run(["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no"])
    return {
        "gpu": torch.cuda.get_device_name(gpu) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "l2_bytes": l2_bytes(gpu) if cuda else None,
        "driver": smi.splitlines()[0] if smi else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": _version("triton", "triton"),
        "flashinfer": _version("flashinfer-python", "flashinfer"),
        "cutlass": _version("nvidia-cutlass-dsl", "cutlass"),
        "python": platform.python_version(),
        "git_commit": commit,
        "git_dirty": bool(status) if status is not None else None,
        "git_tree": git_tree(),
        "hostname": socket.gethostname(),
        "date": _now(),
    }


def report_table(rows: list[dict]) -> str:
    """The rows as a markdown table (missing fields left blank)."""
    cols = [("point", "point", None), ("variant", "variant", None), ("backend", "backend", None),
            ("shape", "shape", None), ("median us", "median_us", ".2f"), ("p10 us", "p10_us", ".2f"),
            ("p90 us", "p90_us", ".2f"), ("spread", "spread", ".1%"), ("floor us", "floor_us", ".2f"),
            ("% of floor", "pct_of_floor", ".1f"), ("first call ms", "first_call_ms", ".1f"),
            ("vs reference", "speedup_vs_reference", ".2f")]
    lines = ["| " + " | ".join(c[0] for c in cols) + " | note |", "|" + "---|" * (len(cols) + 1)]
    for r in rows:
        cells = ["" if r.get(k) is None else format(r[k], f) if f else str(r[k]) for _, k, f in cols]
        if r.get("config"):
            cells[1] += f" `{config_text(r['config'])}`"
        if cells[-1]:
            cells[-1] += "x"
        note = r.get("error") or (f"graph fallback: {r['graph_error']}" if r.get("graph_error") else "")
        note = "; ".join(x for x in (note, r.get("note")) if x)
        lines.append("| " + " | ".join(cells + [note.replace("|", "/")]) + " |")
    return "\n".join(lines)


def write_results(rows: list[dict], out_dir, command: str, env: dict | None = None,
                  extra: dict | None = None) -> dict[str, Path]:
    """bench.json ({"command", "environment", "rows", **extra}) and report.md under `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = env or environment()
    doc = {"command": command, "environment": env, "rows": rows, **(extra or {})}
    (out / "bench.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    md = [f"# Bench: {out.name}", "", "```", command, "```", "", "## Environment", ""]
    md += [f"- {k}: {v}" for k, v in env.items()]
    md += ["", "## Results", "", "Times in microseconds (median of reps; spread = (p90 - p10) / median); "
           "floor = max(bytes / copy bandwidth, FLOPs / bf16 matmul rate); speed-ups are ratios "
           "within this run.", "", report_table(rows), ""]
    kernels = kernels_table(rows)
    if kernels:
        md += ["## Kernels per call", "", "One eager call of each variant under torch.profiler (device time; "
               "ATen ops on a CPU), after its timing.", kernels, ""]
    (out / "report.md").write_text("\n".join(md))
    return {"bench.json": out / "bench.json", "report.md": out / "report.md"}
