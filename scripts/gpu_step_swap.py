"""Time a lock's whole target step against the same build with one point's variant swapped, in one
process on one model: a new variant's end-to-end effect before a re-lock (which searches every point
and times a dozen builds). Builds alternate, A B A B ..., so drift hits both alike. Each timing is
`bench.time_fn` over the step as the search's end-to-end stage times it (eager prefill, graphed decode).

    python3 scripts/gpu_step_swap.py LOCK POINT VARIANT [--config JSON ... | --all-configs] [--rounds 2]
        [--out FILE]

e.g. `scripts/gpu_step_swap.py runs/optimize-prefill-8x2k-beam-501b-tp8/lock.yaml experts flashinfer_down`
(no --config: the variant's default). Writes every timing to --out as JSON.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from beam_model import BeamForCausalLM  # noqa: E402
from workbench import bench, registry  # noqa: E402
from workbench.lock import Lock  # noqa: E402
from workbench.search import STEP_SAMPLES_S  # noqa: E402
from workbench.targets import StepRunner, for_device, get_target  # noqa: E402
from workbench.variants._inputs import DTYPES  # noqa: E402


def _builds(lock: Lock, point: str, variant: str, configs: list[dict | None]) -> dict:
    """label -> (selection, configs): the lock's build, then the swapped one at each config."""
    builds = {"lock": (lock.selection, lock.configs)}
    kept = {p: c for p, c in lock.configs.items() if p != point}
    for cfg in configs:
        label = f"{point}:{variant}" + (f" {json.dumps(cfg)}" if cfg else "")
        builds[label] = ({**lock.selection, point: variant}, {**kept, **({point: cfg} if cfg else {})})
    return builds


def build_step(lock: Lock, preset: str, device: str) -> StepRunner:
    """The lock's target step on a model of `preset` (random weights) at the lock's dtype."""
    started = time.monotonic()
    model = BeamForCausalLM.from_preset(preset, dtype=DTYPES[lock.model["dtype"]], device=device)
    runner = StepRunner(model, for_device(get_target(lock.target), torch.device(device)))
    print(f"built {preset} and the {lock.target} step in {time.monotonic() - started:.0f} s", flush=True)
    return runner


def time_builds(runner: StepRunner, builds: dict, *, rounds: int, device: str) -> tuple[dict, dict]:
    """Each build (label -> (selection, configs)) bound and timed in turn, `rounds` times over: every
    timing by label, and each label's best median in ms. A build that fails is reported, the others
    still timed."""
    results = {label: [] for label in builds}
    for r in range(rounds):
        for label, (selection, configs) in builds.items():
            try:
                runner.rebind(selection, configs)
                timing = bench.time_fn(runner, device=device, budget_s=STEP_SAMPLES_S)
            except Exception as e:
                results[label].append({"error": f"{type(e).__name__}: {e}"})
                print(f"round {r}: {label}: failed: {type(e).__name__}: {e}", flush=True)
                continue
            results[label].append(timing)
            print(f"round {r}: {label}: {timing['median_us'] / 1e3:.3f} ms (spread {timing['spread']:.1%})",
                  flush=True)
    best = {label: min(x["median_us"] for x in runs if "median_us" in x) / 1e3
            for label, runs in results.items() if any("median_us" in x for x in runs)}
    first = next(iter(builds))
    for label, ms in best.items():
        ratio = f" ({best[first] / ms:.3f}x {first}'s step)" if first in best and label != first else ""
        print(f"best of {rounds}: {label}: {ms:.3f} ms{ratio}")
    return results, best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("lock")
    ap.add_argument("point")
    ap.add_argument("variant")
    ap.add_argument("--config", action="append", default=[], help="a config of VARIANT (repeatable)")
    ap.add_argument("--all-configs", action="store_true", help="every registered config of VARIANT")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    ap.add_argument("--preset", help="another preset than the lock's (a CPU smoke run)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    lock, problems = Lock.load(args.lock)
    if problems:
        print("lock problems (timed as written):", problems)
    runner = build_step(lock, args.preset or lock.model["preset"], args.device)
    swapped = registry.get(args.point, args.variant).configs if args.all_configs else []
    builds = _builds(lock, args.point, args.variant, [*swapped, *map(json.loads, args.config)] or [None])
    results, best = time_builds(runner, builds, rounds=args.rounds, device=args.device)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "device": torch.cuda.get_device_name()
                       if args.device.startswith("cuda") else args.device, "torch": torch.__version__,
                       "best_ms": best, "timings": results}, f, indent=1)


if __name__ == "__main__":
    main()
