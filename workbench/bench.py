"""Benching a fusion point: time its variants at one workload against the reference and the roofline.

`bench_point` times a point's variants (the reference always included, first, in the same run; each
tuning config a row) at one `Workload` and returns bench.json rows; `time_variant` times one variant
with inputs from its point's spec, as the search does. `workbench.bench_report` writes the rows.

What it must never do: compute a metric from anything but the point's `PointSpec` (inputs, bytes,
FLOPs come from the spec, never from a variant); let one failing variant abort a bench (it gets an
error row); report a speed-up that is not a ratio of two timings from the same run; time on zeros
(inputs come from `make_inputs` with a seed); import the CLI or the TUI.
"""

from __future__ import annotations

from typing import Callable

import torch

from workbench import registry
from workbench.gates import op_gate
from workbench.points import Call, Workload, spec
from workbench.quarantine import quarantined
from workbench.roofline import floor_us, measure_device_ceilings
from workbench.timing import Timing, as_device, describe_error, invoke, time_call

ROW_FIELDS = ("point", "variant", "backend", "shape", "batch", "dtype", "median_us", "p10_us", "p90_us",
              "floor_us", "speedup_vs_reference")  # the design doc's bench.json schema; rows add more


def with_prepared_weights(variant: registry.Variant, call: Call) -> Call:
    """`call` with its weights in the variant's layout (`prepare`), as the model would hold them."""
    if call.weights_arg is None:
        return call
    return call.with_weights(variant.prepare_weights(call.args[call.weights_arg]))


def _timed_variant(variant: registry.Variant, base_call: Callable[[int], Call], *, device, config=None,
                   touched_bytes=None, **timing_kw) -> Timing:
    prepared: dict[int, Call] = {}

    def make_call(i: int) -> Call:
        if i not in prepared:  # the weight-layout transform runs once per copy, outside the timing
            prepared[i] = with_prepared_weights(variant, base_call(i))
        return prepared[i]

    try:
        return time_call(variant.at(config), make_call, device=device, touched_bytes=touched_bytes, **timing_kw)
    finally:
        prepared.clear()
        if as_device(device).type == "cuda":
            torch.cuda.empty_cache()


def time_variant(variant: registry.Variant, workload: Workload, *, device="cpu", config: dict | None = None,
                 seed: int = 0, **timing_kw) -> dict:
    """One variant (at a tuning config) at one workload, inputs from its point's spec: Timing.as_dict()."""
    point_spec = spec(variant.point)
    return _timed_variant(variant, lambda i: point_spec.make_inputs(workload, as_device(device), seed + i),
                          device=device, config=config, touched_bytes=int(point_spec.bytes(workload)),
                          **timing_kw).as_dict()


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
    device = as_device(device)
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
        why = v.unsupported(workload, device)
        row["error"] = f"unavailable: {why}" if why else skipped.get(v.name)
        if config and v.configure is None:
            row["error"] = f"{v.qualname} takes no tuning config"
        elif not why and not row["error"]:
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
            row["error"] = describe_error(e)
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

    call, fn = with_prepared_weights(v, call), v.at(config)
    try:
        row["kernels"] = kernels_per_call(lambda: invoke(fn, call), device)
    except Exception as e:
        row["kernels_error"] = describe_error(e)


def _configs_of(v: registry.Variant, configs: str | list[dict] | None) -> list[dict | None]:
    """The configs a bench times `v` at: the reference and config-less variants at their default."""
    if configs is None or v.name == registry.REFERENCE:
        return [None]
    return v.tuning_configs() if configs == "all" else list(configs)
