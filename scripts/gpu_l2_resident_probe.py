"""Would prefetching a decode point's weights into L2 pay? An upper bound, per point.

In the decode-b1 lock's step the small points (router GEMV, attn_out's o_proj GEMV, qkvg_proj ...) run
at a fraction of the copy bandwidth: they are latency-bound, and a load served by L2 instead of HBM
has less latency. While attention runs (latency-bound, HBM idle) another stream could pull the next
points' weights into L2. Before building that, this times each point of the lock at its decode-b1
shapes twice, in one process, with the workbench's timer (CUDA graphs of calls back to back):
- cold: inputs and weights rotated over twice the L2 (as the search times them);
- hot: one copy of the inputs for all the calls of a graph, so after the first call everything the point
  reads is in L2.
hot minus cold, times the calls in a step, bounds what such a prefetch could win.

    PYTHONPATH=. python3 scripts/gpu_l2_resident_probe.py --lock runs/optimize-decode-b1-beam-501b-tp8/lock.yaml \
        [--out FILE]
"""

import argparse
import json

import torch

from workbench import bench, registry
from workbench.lock import Lock
from workbench.points import spec
from workbench.targets import get_target

POINTS = ("boundary", "qkvg_proj", "qk_prep", "attention", "attn_out", "route", "dense_mlp", "head")


def hot_timing(variant, workload, device, config) -> dict:
    """GRAPH_CALLS calls on one copy of the inputs per graph (the timer's graphs hold that many calls:
    with fewer, a replay's launch latency would count), so every call after the first reads L2."""
    point_spec = spec(variant.point)
    call = bench._with_prepared_weights(variant, point_spec.make_inputs(workload, torch.device(device), 0))
    touched = int(point_spec.bytes(workload))
    return bench.time_call(variant.at(config), lambda i: call, device=device, touched_bytes=touched,
                           rotate_bytes=bench.GRAPH_CALLS * touched).as_dict()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lock", required=True)
    ap.add_argument("--out")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script, nothing to read from it")
    args = ap.parse_args()
    lock, problems = Lock.load(args.lock)
    target = get_target(lock.target)
    preset, dtype = lock.model["preset"], lock.model["dtype"]
    result = {"lock": args.lock, "lock_problems": problems, "environment": bench.environment(args.device),
              "points": {}}
    for point in POINTS:
        entry = lock.points[point]
        layer = "model" if point == "head" else "sliding"
        workload = target.workload(preset, dtype, layer)
        name, config = entry["variant"], entry.get("config")
        why = registry.get(point, name).unsupported(workload, args.device)
        if why:  # a backend this host lacks (FlashInfer, CUTLASS DSL): its Triton variant stands in
            name, config = "triton", None
        variant = registry.get(point, name)
        row = {"variant": name, "locked_variant": entry["variant"], "locked_unsupported": why, "config": config,
               "workload": str(workload)}
        try:
            cold = bench.time_variant(variant, workload, device=args.device, config=config)
            hot = hot_timing(variant, workload, args.device, config)
        except Exception as e:  # a backend missing on this host: say so and go on
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            print(f"{point}: {row['error']}", flush=True)
            result["points"][point] = row
            continue
        row.update(cold_us=cold["median_us"], cold_spread=cold["spread"], hot_us=hot["median_us"],
                   hot_spread=hot["spread"], graph=cold.get("graph"))
        print(f"{point} {name}: cold {cold['median_us']:.2f} us, hot {hot['median_us']:.2f} us",
              flush=True)
        result["points"][point] = row
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
