"""`serve --tp N`: the processes of a tensor-parallel server and each rank's shard of the model.

Rank 0 is the serving process itself; ranks 1..N-1 are spawned (`rank_main`), die with it (a
parent-death signal) and only with it (a process group of their own, SIGINT ignored), and join one
torch.distributed group (NCCL on GPUs, one per rank; gloo on the CPU) plus a gloo group for control
messages. Each rank reads only its own slices of a checkpoint (`beam_model.tp.load_shard`); a preset's
random weights are made whole on each rank, then sliced. What runs on the ranks is `server.engine.ranks`.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import signal
import tempfile

import torch
import torch.distributed as dist

START_TIMEOUT = datetime.timedelta(minutes=10)  # how long the ranks may take to meet at start-up


@dataclasses.dataclass
class RankSpec:
    world: int
    init_method: str
    device_type: str
    model: str | None
    preset: str | None
    seed: int
    dtype: str
    expert_parallel: bool = False  # the MoE layers split by whole experts (beam_model/tp.py)
    weights: str = "bf16"  # a preset's stored format (a checkpoint's config.json says its own)


def device_for(spec: RankSpec, rank: int) -> torch.device:
    return torch.device("cuda", rank) if spec.device_type == "cuda" else torch.device("cpu")


def join(spec: RankSpec, rank: int):
    """This process as `rank` of the group: the data group's backend by device, and the control group."""
    if spec.device_type == "cuda":
        torch.cuda.set_device(rank)
    backend = "nccl" if spec.device_type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=spec.init_method, rank=rank, world_size=spec.world,
                            timeout=START_TIMEOUT)
    return dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD


def load_rank_model(spec: RankSpec, rank: int):
    """This rank's shard, on its device, bound to the reference variants (rank 0's plan rebinds them)."""
    from beam_model.model import BeamForCausalLM
    from beam_model.tp import load_shard, shard_model
    from workbench.dtypes import dtype_of

    dtype, device = dtype_of(spec.dtype), device_for(spec, rank)
    if spec.model:
        return load_shard(spec.model, rank, spec.world, dist.group.WORLD, dtype=dtype, device=device,
                          expert_parallel=spec.expert_parallel)
    full = BeamForCausalLM.from_preset(spec.preset, seed=spec.seed, dtype=dtype, device=device, weights=spec.weights)
    return shard_model(full, rank, spec.world, dist.group.WORLD, expert_parallel=spec.expert_parallel)


def rank_main(rank: int, spec: RankSpec) -> None:
    """A rank other than 0 (spawned): join, load its shard, follow rank 0 until it says stop."""
    from server.engine.ranks import follow
    from workbench.agent.worker import PR_SET_PDEATHSIG, _prctl

    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # never outlive the server
    # Rank 0 decides when the ranks end: a Ctrl-C or a signal to the terminal's process group is its alone
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(max(1, torch.get_num_threads() // spec.world))
    control = join(spec, rank)
    try:
        follow(load_rank_model(spec, rank), control)
    finally:
        dist.destroy_process_group()


def start(args, world: int, device: torch.device, dtype: str):
    """Spawn ranks 1..world-1 and join as rank 0. Returns (spec, processes by rank, control group)."""
    import torch.multiprocessing as mp

    from beam_model.config import BeamConfig
    from beam_model.quant.scheme import QuantScheme, read_config
    from beam_model.tp import check_shardable

    weights = args.weights or "bf16"
    if args.model:
        config, quant = read_config(args.model)
    else:
        config = BeamConfig.from_preset(args.preset)
        quant = None if weights == "bf16" else QuantScheme.for_format(weights)
    check_shardable(config, world, args.ep, quant)
    if device.type == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(f"--tp {world} needs {world} GPUs; {torch.cuda.device_count()} are visible")
    rendezvous = os.path.join(tempfile.mkdtemp(prefix="beam-tp-"), "rendezvous")
    spec = RankSpec(world, f"file://{rendezvous}", device.type, args.model, args.preset, args.seed, dtype, args.ep,
                    weights)
    ctx = mp.get_context("spawn")
    procs = {}
    for rank in range(1, world):
        procs[rank] = ctx.Process(target=rank_main, args=(rank, spec), name=f"beam-rank-{rank}", daemon=True)
        procs[rank].start()
    return spec, procs, join(spec, 0)
