"""Run one function on N spawned ranks of a torch.distributed group and collect what each returns.

The harness's way to run anything across ranks (the rank gate, a tensor-parallel step's timing): each
rank is a spawned process (CUDA cannot fork) that joins one group (NCCL with a GPU per rank; gloo on
the CPU, or on CUDA when there are fewer GPUs than ranks, every rank then sharing GPU 0), calls
`fn(rank, world, device, *args)` and leaves its result in a file. The caller gets every rank's result
or why it has none: a rank that raised (its error text), died, or was still running at the time limit
(stopped then, never waited on: a rank waiting in a collective another rank skipped would wait forever).
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class RankResult:
    value: Any = None          # what fn returned
    error: str | None = None   # why there is no value


def backend_for(device_type: str, world: int) -> str:
    return "nccl" if device_type == "cuda" and torch.cuda.device_count() >= world else "gloo"


def run_ranks(fn, world: int, *, device_type: str = "cpu", args: tuple = (), timeout_s: float = 120.0
              ) -> list[RankResult]:
    """`fn(rank, world, device, *args)` on `world` spawned ranks; one RankResult per rank. `fn` and
    `args` must pickle (a module-level function; functools.partial of one)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="ranks-") as folder:
        procs = [ctx.Process(target=_rank_main, name=f"rank-{r}", daemon=True,
                             args=(fn, r, world, device_type, args, folder, timeout_s)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        results = []
        for r, p in enumerate(procs):
            value_path, error_path = (os.path.join(folder, f"rank{r}.{x}") for x in ("pt", "error"))
            if p.is_alive():
                p.kill()
                p.join()
                results.append(RankResult(error=f"rank {r} did not finish within {timeout_s:g} s "
                                                f"(waiting in a collective another rank skipped?)"))
            elif os.path.exists(value_path):
                results.append(RankResult(torch.load(value_path, weights_only=False)))
            elif os.path.exists(error_path):
                with open(error_path) as f:
                    results.append(RankResult(error=f"rank {r}: {f.read()}"))
            else:
                results.append(RankResult(error=f"rank {r} exited with code {p.exitcode}"))
        return results


def lockstep_seconds(run, device) -> float:
    """Inside a rank: `run()` timed from a barrier every rank passes to the device's idle end, so the
    ranks time the same work together (a rank ahead would otherwise time its wait for the others)."""
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _rank_main(fn, rank, world, device_type, args, folder, timeout_s) -> None:
    import torch.distributed as dist

    from workbench.gates import _error_text

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    backend = backend_for(device_type, world)
    device = torch.device("cuda", rank if backend == "nccl" else 0) if device_type == "cuda" else torch.device("cpu")
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"file://{os.path.join(folder, 'rendezvous')}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        try:
            value = fn(rank, world, device, *args)
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - the caller reports it by rank
        with open(os.path.join(folder, f"rank{rank}.error"), "w") as f:
            f.write(_error_text(e))
        raise
    torch.save(value, os.path.join(folder, f"rank{rank}.pt"))
