"""Timing one callable: medians of rotated calls, as the device runs them in a model step.

`time_call` times `fn(*call.args, **call.kwargs)` on rotating copies of its inputs and weights (CUDA
events on a GPU, `perf_counter_ns` on the CPU), optionally replaying CUDA graphs of several calls back
to back, as the server runs decode; `time_fn` times a no-argument callable that brings its own data
(a whole target step). Both report a `Timing`: median, p10/p90, spread, the copies rotated and how.

What it must never do: time on data it made up (the caller's `make_call` makes every input); count a
first call's JIT builds, compiles or autotuning in a median (they are reported apart, `first_call_ms`);
decide anything from a timing (the noise bands are `workbench.noise`'s, the choices the search's).
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from workbench.points import Call, leaves, map_leaves

# Names this process in the timings it makes: a resumed run keeps earlier processes' timings, and only
# timings of one process make a ratio (another process, or another start of the GPU host, runs the same
# build at another speed).
PROCESS_ID = uuid.uuid4().hex[:12]

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

def as_device(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def l2_bytes(device) -> int | None:
    device = as_device(device)
    if device.type != "cuda":
        return None
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", None) or None


def default_rotate_bytes(device) -> int:
    """Twice the L2 on a GPU (120 MB on an H200), so no copy is still cached when its turn comes."""
    return 2 * (l2_bytes(device) or 32 << 20) if as_device(device).type == "cuda" else CPU_ROTATE_BYTES


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


def describe_error(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    if e.__context__ is not None and e.__context__ is not e:  # capture_end's error hides the cause
        msg += f" (during: {describe_error(e.__context__)})"
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
    device = as_device(device)
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
                graph_error = describe_error(e)
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


def time_fn(fn: Callable[[], Any], *, device="cpu", budget_s: float = 2.0, **timing_kw) -> dict:
    """A no-argument callable that brings its own data and graph (a whole target step): no rotation.
    A slow step (a prefill of thousands of tokens takes 0.1-4 s) gets fewer warm-up calls and samples
    (`reps_for` within `budget_s`), so an end-to-end stage times its ~a dozen builds in minutes, not an hour."""
    device = as_device(device)
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
