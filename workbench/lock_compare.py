"""Several locks' builds of one target timed in one process, so their step times compare: e.g. the BF16,
FP8 and NVFP4 decode locks of one preset.

Each lock's model (its preset, or one preset for every lock, random weights in the lock's format and
dtype) is built in turn, its step captured and timed as the end-to-end stage times a build
(`timing.time_fn` on the target's `StepRunner`), then freed before the next: at full size two formats'
models do not fit one GPU together. The locks are timed in rounds, each round in the order opposite to
the last, so the device's drift over the run reaches every lock alike; a lock's time is the median of
its rounds.

What it must never do: time a lock that fails verification unless forced (a forced lock's row then says
what failed), or compare locks of different targets (their steps are different work).
"""

from __future__ import annotations

import gc
import statistics

import torch

from workbench import timing
from workbench.lock import Lock, load_forced
from workbench.targets import StepRunner, for_device, get_target


def compare_locks(paths: list[str], *, preset: str | None = None, rounds: int = 3, budget_s: float = 2.0,
                  device=None, force: bool = False, seed: int = 0, on_timed=None) -> dict:
    """{"target", "preset", "rounds", "locks": [{"lock", "preset", "weights", "dtype", "notes", "forced_past",
    "round_us", "median_us", "over_first"}]}: each lock's step time (us) in every round, their median, and its
    ratio to the first lock's; `forced_past`: the verification problems `force` let a lock past. `preset`
    (default: each lock's own) builds every lock on that preset; `on_timed(path, round, us)` is called after
    each timing."""
    if not paths:
        raise ValueError("no lock files to compare")
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    loaded = {path: load_forced(path, force=force, device=device) for path in paths}
    locks = {path: lock for path, (lock, _) in loaded.items()}
    targets = {path: lock.target for path, lock in locks.items()}
    if len(set(targets.values())) > 1:
        raise ValueError("the locks time different targets: "
                         + ", ".join(f"{path} ({t})" for path, t in targets.items()))
    target = for_device(get_target(next(iter(targets.values()))), device)  # a CPU step shrunk as optimize's
    selections = {path: lock.current_selection() for path, lock in locks.items()}  # (today's names, notes)
    times = {path: [] for path in paths}
    for r in range(rounds):
        for path in (paths if r % 2 == 0 else paths[::-1]):
            us = _time_lock(locks[path], selections[path][0], target, preset, budget_s, device, seed)
            times[path].append(us)
            if on_timed is not None:
                on_timed(path, r, us)
    first = statistics.median(times[paths[0]])
    rows = []
    for path, lock in locks.items():
        median = statistics.median(times[path])
        rows.append({"lock": path, "preset": preset or lock.model.get("preset"),
                     "weights": lock.model.get("weights", "bf16"), "dtype": lock.model.get("dtype", "bf16"),
                     "notes": selections[path][1], "forced_past": loaded[path][1], "round_us": times[path],
                     "median_us": median,
                     "over_first": median / first})
    return {"target": target.name, "preset": preset, "rounds": rounds, "device": str(device), "locks": rows}


def _time_lock(lock: Lock, selection: dict[str, str], target, preset: str | None, budget_s: float, device,
               seed: int) -> float:
    from beam_model.model import BeamForCausalLM
    from workbench.dtypes import dtype_of

    name = preset or lock.model.get("preset")
    if not name:
        raise ValueError("the lock names no preset to build its model from: give one for every lock")
    model = BeamForCausalLM.from_preset(name, seed=seed, dtype=dtype_of(lock.model.get("dtype", "bf16")),
                                        device=device, weights=lock.model.get("weights", "bf16"))
    runner = StepRunner(model, target)
    runner.rebind(selection, lock.configs)
    us = timing.time_fn(runner, device=device, budget_s=budget_s)["median_us"]
    del runner, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the next lock's model needs the memory
    return us
