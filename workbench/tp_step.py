"""A target step timed on N tensor-parallel ranks at once: what a TP deployment's step costs.

Each rank (`workbench.multirank`: NCCL with a GPU each, else gloo) builds random weights of one rank's
shapes (the preset is a rank's shapes, as beam-501b-tp8 is one rank of TP8), joins them into the group
(`beam_model.tp.TensorParallel`), so the vocab-parallel embedding, every boundary's all-reduce and the
logits' all-gather run for real, binds the build's variants and runs the target step as the server
does (`targets.StepRunner`: a CUDA graph at decode when the group is NCCL; gloo collectives cannot be
captured). The ranks time the same number of steps in lockstep, each step between a barrier and a
device sync; the slowest rank's median is the step's time, since every rank waits for it at the next
all-reduce. With one rank nothing is reduced (a rank's partial sum is the whole sum, so the model skips
every collective, as serving on one GPU does), and the same step without a group alternates with it:
`alone` and the round-by-round `paired_ratio` (group over alone) say what running as a rank of an NCCL group
costs the step.
"""

from __future__ import annotations

import statistics

import torch

from workbench.multirank import backend_for, lockstep_seconds, run_ranks
from workbench.timing import summarize

DEFAULT_REPS = 50
DEFAULT_WARMUP = 5


def time_tp_step(preset: str, target: str, world: int, *, device_type: str = "cpu", dtype: str = "bf16",
                 weights: str = "bf16", selection: dict | None = None, configs: dict | None = None,
                 reps: int = DEFAULT_REPS, warmup: int = DEFAULT_WARMUP, seed: int = 0,
                 timeout_s: float = 600.0) -> dict:
    """Each rank's step timing and the step's (the slowest rank's median). Raises a RuntimeError naming
    every rank that failed."""
    if world < 1 or reps < 1:
        raise ValueError(f"a TP step needs at least one rank and one timed step, got {world} ranks, {reps} reps")
    ranks = run_ranks(_rank_step, world, device_type=device_type, timeout_s=timeout_s,
                      args=(preset, target, dtype, weights, selection, configs, reps, warmup, seed))
    failed = [r.error for r in ranks if r.error]
    if failed:
        raise RuntimeError("the TP step failed: " + "; ".join(failed))
    per_rank = [r.value for r in ranks]
    slowest = max(range(world), key=lambda r: per_rank[r]["median_ms"])
    return {"preset": preset, "target": target, "world": world, "backend": backend_for(device_type, world),
            "dtype": dtype, "weights": weights, "variants": selection or {}, "reps": reps,
            "step_ms": per_rank[slowest]["median_ms"], "slowest_rank": slowest, "per_rank": per_rank}


def time_tp_builds(preset: str, target: str, world: int, builds: dict[str, tuple[dict | None, dict | None]], *,
                   device_type: str = "cpu", dtype: str = "bf16", weights: str = "bf16", reps: int = DEFAULT_REPS,
                   warmup: int = DEFAULT_WARMUP, seed: int = 0, timeout_s: float = 600.0) -> dict:
    """Several builds' steps on `world` ranks, timed one after the other by the same rank processes on
    the same weights: per build ({name: (selection, configs)}) each rank's timing and the step's (the
    slowest rank's median). Raises a RuntimeError naming every rank that failed."""
    if world < 1 or reps < 1 or not builds:
        raise ValueError(f"TP builds need at least one rank, timed step and build, got {world} ranks, {reps} reps, "
                         f"{len(builds)} builds")
    ranks = run_ranks(_rank_builds, world, device_type=device_type, timeout_s=timeout_s,
                      args=(preset, target, dtype, weights, builds, reps, warmup, seed))
    failed = [r.error for r in ranks if r.error]
    if failed:
        raise RuntimeError("the TP builds' steps failed: " + "; ".join(failed))
    timed = {}
    for name in builds:
        per_rank = [r.value[name] for r in ranks]
        slowest = max(range(world), key=lambda r: per_rank[r]["median_ms"])
        timed[name] = {"step_ms": per_rank[slowest]["median_ms"], "slowest_rank": slowest, "per_rank": per_rank}
    return {"preset": preset, "target": target, "world": world, "backend": backend_for(device_type, world),
            "dtype": dtype, "weights": weights, "reps": reps, "builds": timed}


def _rank_builds(rank, world, device, preset, target, dtype, weights, builds, reps, warmup, seed) -> dict:
    import torch.distributed as dist

    from beam_model.model import BeamForCausalLM
    from beam_model.tp import TensorParallel
    from workbench.dtypes import dtype_of
    from workbench.targets import StepRunner, for_device, get_target

    model = BeamForCausalLM.from_preset(preset, seed=seed + rank, dtype=dtype_of(dtype), device=device,
                                        weights=weights)
    model.tp = TensorParallel(dist.group.WORLD, rank, world)
    use_graph = device.type == "cuda" and dist.get_backend() == "nccl" and get_target(target).graphed
    step = for_device(get_target(target), device)
    out = {}
    for name, (selection, configs) in builds.items():
        model.set_variants(selection, configs)
        runner = StepRunner(model, step, seed=seed, use_graph=use_graph)  # one seed: every rank steps the same ids
        times = [lockstep_seconds(runner, device) * 1e3 for _ in range(warmup + reps)][warmup:]
        out[name] = {"rank": rank, **_summary(times), "reps": reps, "graph": runner.graph is not None}
        del runner  # its graph and cache before the next build's
    return out


def _rank_step(rank, world, device, preset, target, dtype, weights, selection, configs, reps, warmup, seed) -> dict:
    import torch.distributed as dist

    from beam_model.model import BeamForCausalLM
    from beam_model.tp import TensorParallel
    from workbench.dtypes import dtype_of
    from workbench.targets import StepRunner, for_device, get_target

    model = BeamForCausalLM.from_preset(preset, seed=seed + rank, dtype=dtype_of(dtype), device=device,
                                        weights=weights)
    model.set_variants(selection, configs)
    use_graph = device.type == "cuda" and dist.get_backend() == "nccl" and get_target(target).graphed
    step = for_device(get_target(target), device)
    # With one rank the same step without a group runs beside it, alternating: what the rank's runtime costs
    parallel = {"group": TensorParallel(dist.group.WORLD, rank, world)}
    if world == 1:
        parallel["alone"] = TensorParallel(None, 0, 1)
    runners = {}
    for name, tp in parallel.items():  # one seed: every rank steps the same ids
        model.tp = tp
        runners[name] = StepRunner(model, step, seed=seed, use_graph=use_graph)
    times = {name: [] for name in runners}
    for i in range(warmup + reps):
        for name, runner in runners.items():
            model.tp = parallel[name]  # an eager step reads it as it runs; a graph captured it
            ms = lockstep_seconds(runner, device) * 1e3
            if i >= warmup:
                times[name].append(ms)
    out = {"rank": rank, **_summary(times["group"]), "reps": reps, "graph": runners["group"].graph is not None,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    if "alone" in times:
        out["alone"] = _summary(times["alone"])
        out["paired_ratio"] = statistics.median(g / a for g, a in zip(times["group"], times["alone"]))
    return out


def _summary(times: list[float]) -> dict:
    median, p10, p90, _ = summarize(times)
    return {"median_ms": median, "p10_ms": p10, "p90_ms": p90}
