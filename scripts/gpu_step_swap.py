"""Time a lock's whole target step against the same build with one point's variant swapped, in one
process on one model: a new variant's end-to-end effect before a re-lock (which searches every point
and times a dozen builds). Builds alternate, A B A B ..., so drift hits both alike. Each timing is
`timing.time_fn` over the step as the search's end-to-end stage times it (eager prefill, graphed decode).

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
from workbench import registry  # noqa: E402
from workbench.end_to_end import STEP_SAMPLES_S  # noqa: E402
from workbench.lock import Lock  # noqa: E402
from workbench.profiler.in_step import time_builds  # noqa: E402
from workbench.targets import StepRunner, for_device, get_target  # noqa: E402
from workbench.variants.inputs import DTYPES  # noqa: E402


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
    results, best = time_builds(runner, builds, rounds=args.rounds, device=args.device, budget_s=STEP_SAMPLES_S)
    for label, ms in best.items():
        ratio = f" ({best['lock'] / ms:.3f}x the lock's step)" if "lock" in best else ""
        print(f"best of {args.rounds}: {label}: {ms:.3f} ms{ratio}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "device": torch.cuda.get_device_name()
                       if args.device.startswith("cuda") else args.device, "torch": torch.__version__,
                       "best_ms": best, "timings": results}, f, indent=1)


if __name__ == "__main__":
    main()
