"""A point that all-reduces, timed on N tensor-parallel ranks at once (`bench POINT --tp N`).

One process cannot time `boundary`'s all-reduce: it has no peers. Here N spawned ranks
(`workbench.multirank`) each hold the point's inputs at the workload, their own partial sum of the
argument the contract all-reduces (drawn from a seed per rank, the other inputs shared), and call each
variant, the reference first, with the group. A timing is a block of `inner` calls between a barrier
and a device sync, captured once in a CUDA graph where the group is NCCL (as the server's decode runs
it) and run eagerly otherwise; every rank times the same blocks in lockstep, and a variant's time is
its slowest rank's median, since the next all-reduce waits for that rank.
"""

from __future__ import annotations

import statistics

import torch

from workbench import registry
from workbench.multirank import backend_for, lockstep_seconds, run_ranks
from workbench.points import spec

DEFAULT_REPS = 50
DEFAULT_INNER = 20
DEFAULT_WARMUP = 3


def bench_across_ranks(point: str, variant_names: list[str] | None, workload, world: int, *,
                       device_type: str = "cpu", reps: int = DEFAULT_REPS, inner: int = DEFAULT_INNER,
                       warmup: int = DEFAULT_WARMUP, seed: int = 0, timeout_s: float = 600.0) -> dict:
    """Each variant's per-call time on every rank, its slowest rank's median and its speed-up over the
    reference's. Raises a ValueError for a point that never communicates, a RuntimeError naming every
    rank that failed."""
    if spec(point).partial_sum is None:
        raise ValueError(f"{point} never communicates: its time on one rank is its time on each "
                         "(`bench` without --tp)")
    names = list(dict.fromkeys([registry.REFERENCE, *(variant_names or registry.variants(point))]))
    for name in names:
        registry.get(point, name)  # an unknown name is the caller's mistake: before any rank starts
    ranks = run_ranks(_rank_bench, world, device_type=device_type, timeout_s=timeout_s,
                      args=(point, names, workload, reps, inner, warmup, seed))
    failed = [r.error for r in ranks if r.error]
    if failed:
        raise RuntimeError(f"{point} across {world} ranks failed: " + "; ".join(failed))
    rows = []
    for name in names:
        per_rank = [r.value[name] for r in ranks]
        errors = [t["error"] for t in per_rank if "error" in t]
        row = {"variant": name, "backend": registry.get(point, name).backend, "error": "; ".join(errors) or None,
               "per_rank_us": [t.get("median_us") for t in per_rank], "graph": per_rank[0].get("graph")}
        row["median_us"] = None if errors else max(row["per_rank_us"])
        rows.append(row)
    ref = rows[0]["median_us"]
    for row in rows:
        row["speedup_vs_reference"] = ref / row["median_us"] if ref and row["median_us"] else None
    return {"point": point, "shape": workload.label(), "world": world, "backend": backend_for(device_type, world),
            "reps": reps, "inner": inner, "rows": rows}


def _rank_bench(rank, world, device, point, names, workload, reps, inner, warmup, seed) -> dict:
    import torch.distributed as dist

    call = spec(point).rank_inputs(workload, device, seed, rank)
    graphed = device.type == "cuda" and dist.get_backend() == "nccl"
    out = {}
    for name in names:
        variant = registry.get(point, name)
        try:
            why = variant.unsupported(workload, device)
            if why:
                raise ValueError(f"unavailable: {why}")
            c = call if call.weights_arg is None else call.with_weights(
                variant.prepare_weights(call.args[call.weights_arg]))  # as the model would hold them
            kwargs = {**c.kwargs, "group": dist.group.WORLD}
            out[name] = {"median_us": _median_us(lambda: variant.fn(*c.args, **kwargs), device, graphed, reps,
                                                 inner, warmup), "graph": graphed}
        except Exception as e:  # noqa: BLE001 - the variant's fault: its row says so
            from workbench.gates import _error_text

            out[name] = {"error": _error_text(e)}
    return out


def _median_us(fn, device, graphed: bool, reps: int, inner: int, warmup: int) -> float:
    def block():
        for _ in range(inner):
            fn()

    run = block
    if graphed:  # warmed up on a side stream first: NCCL's communicator and lazy compiles outside the capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            block()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            block()
        run = graph.replay
    times = [lockstep_seconds(run, device) * 1e6 / inner for _ in range(warmup + reps)]
    return statistics.median(times[warmup:])
