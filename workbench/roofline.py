"""The roofline: what the device can do at best, and the least time a fusion-point call can take.

`measure_device_ceilings` measures the device's copy bandwidth and bf16 matrix-product rate once and
caches them per device name; `floor_us` is a call's floor: its bytes at that bandwidth or its FLOPs
at that rate, whichever takes longer.

What it must never do: take bytes or FLOPs from anywhere but the point's `PointSpec`; measure on
zeros (a matrix product ran 13% faster on zeros on an H200); time a variant.
"""

from __future__ import annotations

import functools
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

import torch

from workbench.points import Workload
from workbench.provenance import now
from workbench.run_folder import read_json, write_json
from workbench.timing import as_device, percentile


def cache_dir() -> Path:
    return Path(os.environ.get("BEAM_WORKBENCH_CACHE") or Path.home() / ".cache" / "beam-workbench")


def device_name(device) -> str:
    device = as_device(device)
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
    device = as_device(device)
    path = cache_dir() / "ceilings.json"
    name = device_name(device)
    cache = read_json(path)
    cache = cache if isinstance(cache, dict) else {}  # a corrupt cache is measured again, not fatal
    if not refresh and name in cache:
        return {k: float(cache[name][k]) for k in ("bandwidth_Bps", "matmul_flops")}
    with torch.inference_mode():
        ceilings = _measure(device)
    cache[name] = {**ceilings, "measured_at": now(), "torch": torch.__version__}
    write_json(path, cache)  # whole: concurrent benches never read half a file
    return ceilings


def floor_us(point_spec, workload: Workload, ceilings: dict) -> float:
    """Roofline floor of one call: max(bytes / bandwidth, flops / matmul rate), in microseconds."""
    return 1e6 * max(point_spec.bytes(workload) / ceilings["bandwidth_Bps"],
                     point_spec.flops(workload) / ceilings["matmul_flops"])
