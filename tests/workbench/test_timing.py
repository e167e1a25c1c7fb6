"""Timing one callable (workbench/timing.py): medians of rotated calls, the first call apart, whole steps."""

import math
import time
from types import SimpleNamespace

import pytest
import torch
from harness_helpers import FAST

from workbench import timing
from workbench.points import Call


def test_time_call_trivial_function_gives_sane_stats():
    x = torch.randn(256)
    t = timing.time_call(lambda a: a + 1, lambda i: Call((x,)), device="cpu", rotate_bytes=0, **FAST)
    assert 0 < t.p10_us <= t.median_us <= t.p90_us < 1e6
    assert t.spread == pytest.approx((t.p90_us - t.p10_us) / t.median_us)
    assert 10 <= t.reps <= 60 and len(t.samples_us) == t.reps
    assert t.copies == 1 and not t.graph and not t.l2_flush


def test_time_call_measures_microseconds():
    t = timing.time_call(lambda: time.sleep(0.002), lambda i: Call(()), device="cpu", rotate_bytes=0,
                        warmup=1, min_reps=5, max_reps=5, max_seconds=1)
    assert 2000 <= t.median_us < 200_000
    assert t.reps == 5


def test_first_call_is_reported_apart_from_the_run_time():
    """A JIT build or compile on the first call shows in first_call_ms and never in the samples."""
    made = []

    def builds_once():
        if not made:
            made.append(1)
            time.sleep(0.2)  # the "JIT build"

    t = timing.time_call(builds_once, lambda i: Call(()), device="cpu", rotate_bytes=0, warmup=1, min_reps=5,
                        max_reps=5, max_seconds=1)
    assert t.first_call_ms >= 200 and t.median_us < 50_000
    assert t.as_dict()["first_call_ms"] == t.first_call_ms


def test_time_call_stops_at_target_spread_and_falls_back_from_graphs_on_cpu():
    t = timing.time_call(lambda: None, lambda i: Call(()), device="cpu", rotate_bytes=0, use_graph=True,
                        warmup=1, min_reps=10, max_reps=10_000, target_spread=math.inf, max_seconds=5)
    assert t.reps == 10  # any spread meets an infinite target after min_reps
    assert not t.graph and "CUDA" in t.graph_error


def test_rotation_cycles_through_distinct_copies():
    made, seen = [], []

    def make_call(i):
        made.append(i)
        return Call((torch.full((1024,), float(i)),))  # 4 KiB per copy

    def fn(x):
        seen.append(x.data_ptr())
        return x

    t = timing.time_call(fn, make_call, device="cpu", rotate_bytes=5 * 4096, warmup=0, min_reps=20, max_reps=20)
    assert t.copies == 5 and made == [0, 1, 2, 3, 4] and t.copy_bytes == 4096
    assert len(set(seen)) == 5
    timed = seen[-20:]
    assert all(timed[j] == timed[j % 5] for j in range(20))  # round robin, every copy in turn
    assert len(set(timed[:5])) == 5


def test_rotation_is_sized_by_touched_bytes_and_capped():
    make = lambda i: Call((torch.zeros(1024),))  # noqa: E731
    t = timing.time_call(lambda x: x, make, device="cpu", rotate_bytes=4096, touched_bytes=1024, **FAST)
    assert t.copies == 4  # only a quarter of each copy is touched per call: 4 copies to cover 4 KiB
    t = timing.time_call(lambda x: x, make, device="cpu", rotate_bytes=1 << 30, max_copies=3, **FAST)
    assert t.copies == 3


def test_call_bytes_counts_shared_storage_once_and_walks_containers():
    a = torch.zeros(100)
    call = Call((a, a[:10], {"w": [torch.zeros(10, dtype=torch.float64)]}), {"k": torch.zeros(5)})
    assert timing.call_bytes(call) == 400 + 80 + 20


def test_slow_make_call_is_completed_with_clones():
    made = []

    def make_call(i):
        made.append(i)
        return Call((torch.full((1024,), float(i)),), {"meta": {"ids": torch.arange(3)}})

    seen = []
    t = timing.time_call(lambda x, meta: seen.append((x.data_ptr(), meta["ids"].data_ptr())), make_call,
                        device="cpu", rotate_bytes=6 * 4096, make_seconds=0, warmup=0, min_reps=6, max_reps=6)
    assert made == [0] and t.copies == 6 and t.fresh_copies == 1
    assert len(set(seen[-6:])) == 6  # clones live in their own memory, nested tensors included


def test_recompiles_while_sampling_are_counted():
    """A compiled callable that recompiles during the timed reps has no valid time: the harness says so."""
    import itertools

    from workbench.timing import time_call

    n = itertools.count()
    shifting = torch.compile(lambda x, k: x + k, backend="eager", dynamic=False)  # new int constant: new graph
    stable = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    kw = dict(warmup=1, min_reps=4, max_reps=4, rotate_bytes=0)
    assert time_call(lambda x: shifting(x, next(n)), lambda i: Call((torch.ones(4),)), **kw).recompiles > 0
    assert time_call(stable, lambda i: Call((torch.ones(4),)), **kw).recompiles == 0


def test_slow_whole_steps_get_fewer_warmups_and_samples(monkeypatch):
    assert timing.reps_for(0.004) == {"warmup": 10, "min_reps": 50}  # a decode step: the defaults
    assert timing.reps_for(0.04) == {"warmup": 10, "min_reps": 50}
    assert timing.reps_for(0.3) == {"warmup": 2, "min_reps": 6}    # a prefill: ~2 s of samples
    assert timing.reps_for(3.5) == {"warmup": 2, "min_reps": 5}    # never fewer than 5
    seen = {}
    monkeypatch.setattr(timing, "_first_call_ms", lambda fn, call, device: 500.0)
    monkeypatch.setattr(timing, "time_call", lambda *a, **kw: seen.update(kw) or SimpleNamespace(as_dict=dict))
    timing.time_fn(lambda: None)
    assert seen["warmup"] == 0 and seen["min_reps"] == 5 and seen["use_graph"] is False  # 2 calls made already
