"""Several processes serving one model: tensor parallelism on torch.distributed, rank 0 the server.

Rank 0 owns the HTTP server, the scheduler, the KV page plan and sampling; every other rank holds its
shard of the weights (`beam_model.tp`) and a `ModelRunner` built from rank 0's plan, and runs every
forward rank 0 runs, on its own KV cache with the same page layout, so the collectives inside the model
(the boundary's all-reduce, the vocab-parallel embedding and head) meet. Rank 0's runner sends each
forward's inputs (token ids, pages, positions, sampling settings) over a gloo group before launching it
(`Leader`); the others take them and run the same graph or eager step (`follow`) until told to stop.
Control messages travel on gloo whatever the data backend (NCCL on GPUs), as other engines do.

A rank that ends while the server runs ends the server (`RankWatch`): its collectives fail, the
requests in flight get errors, and the server stops and exits 1 with the rank and its exit code named.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

import torch.distributed as dist

from server.engine.model_runner import ModelRunner

log = logging.getLogger("beam.ranks")
HARD_EXIT_S = 20.0   # after a rank's death, how long the server may take to shut down before it is ended


def _broadcast(obj, group):
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class Leader:
    """Rank 0's side: the runner plan and each forward's inputs to the other ranks, then "stop"."""

    def __init__(self, group):
        self.group = group

    def send_plan(self, plan: dict, selection: dict, configs: dict) -> None:
        _broadcast(("plan", plan, selection, configs), self.group)

    def attach(self, runner: ModelRunner) -> None:
        runner.before_forward = self._send

    def _send(self, ids, pages, starts, counts, params) -> None:
        _broadcast(("step", ids, pages, starts, counts, params), self.group)

    def stop(self) -> None:
        _broadcast(("stop",), self.group)


def follow(model, group) -> int:
    """Another rank's side: take rank 0's plan, build the runner, run each forward rank 0 runs until
    "stop". Returns the forwards run."""
    kind, plan, selection, configs = _broadcast(None, group)
    if kind != "plan":
        raise RuntimeError(f"rank 0 sent {kind!r} before its runner plan")
    model.set_variants(selection, configs)
    runner = ModelRunner(model, **plan)
    steps = 0
    while True:
        kind, *rest = _broadcast(None, group)
        if kind == "stop":
            return steps
        runner.follow(*rest)
        steps += 1


class RankWatch:
    """Rank 0's watch over the other ranks' processes: the first one to end while the server runs (not
    after `stopping()`) is logged with its exit code and `on_death()` is called (the server's graceful
    stop); this process is ended with exit code 1 HARD_EXIT_S later if it is still there (a start-up
    that waits for the dead rank). `died` names it."""

    def __init__(self, procs: dict[int, object], on_death):
        self.procs = procs  # rank -> multiprocessing.Process
        self.on_death = on_death
        self.died: str | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="beam-rank-watch", daemon=True)
        self._thread.start()

    def stopping(self) -> None:
        self._stopping.set()

    def _watch(self) -> None:
        from multiprocessing.connection import wait

        sentinels = {p.sentinel: rank for rank, p in self.procs.items()}
        ended = wait(list(sentinels))
        if self._stopping.is_set():
            return
        rank = sentinels[ended[0]]
        proc = self.procs[rank]
        proc.join(timeout=1)
        self.died = f"rank {rank} exited with code {proc.exitcode}"
        print(f"error: {self.died} while serving; the server stops", file=sys.stderr, flush=True)
        log.error("%s while serving; stopping the server", self.died)
        self.on_death()
        timer = threading.Timer(HARD_EXIT_S, lambda: os._exit(1))
        timer.daemon = True
        timer.start()
