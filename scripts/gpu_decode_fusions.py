"""Time the decode fusions against what the decode lock runs in their place, in one process: each
fusion variant at every tuning config against the lock's choice at that point (its attention and
attn_out run apart where it locked no attention_out fusion), per step (layer counts from the run
folder's reference profile; sliding and full layers apart for attention). Every candidate is timed
in turn, then all again: the second round shows the host's drift.

Usage (repository root, GPU host):
    python3 scripts/gpu_decode_fusions.py [RUN_DIR] OUT.json [--points attention_out experts]
Fusions timed: attention_out:triton, attention_out:triton_merged, attention_out:triton_prefetch and
attention_out:triton_widemerge; experts:triton_persistent. ONLY=NAME,... times only those fusions
(and the lock's choice).
"""

import functools
import json
import os
import subprocess
import sys
import types

import torch
import triton

from workbench import bench
from workbench.lock import Lock
from workbench.points import Workload
from workbench.registry import Variant, get, split_of, variants

# A CPU smoke run: PRESET=beam-tiny DEVICE=cpu TRITON_INTERPRET=1
PRESET = os.environ.get("PRESET", "beam-501b-tp8")
DEVICE = os.environ.get("DEVICE", "cuda")


FUSIONS = {"attention_out": ("triton", "triton_merged", "triton_prefetch", "triton_widemerge"),
           "experts": ("triton_persistent",)}
if os.environ.get("ONLY"):
    FUSIONS = {p: tuple(n for n in names if n in os.environ["ONLY"].split(",")) for p, names in FUSIONS.items()}


def _locked(lock: Lock, point: str):
    """(label, variant, config) of what the lock runs at `point`."""
    entry = lock.points.get(point, {"variant": "torch"})
    if point == "attention_out" and entry["variant"] == "torch":  # no fusion locked: its members apart
        members = {p: get(p, lock.points[p]["variant"]).at(lock.points[p].get("config"))
                   for p in ("attention", "attn_out")}
        return ("apart (the lock's attention + attn_out)",
                Variant("attention_out", "apart", "triton",
                        functools.partial(split_of("attention_out"), types.SimpleNamespace(**members))), None)
    return f"locked {point}:{entry['variant']} {entry.get('config')}", get(point, entry["variant"]), entry.get("config")


def main(run_dir: str, out_path: str, points: list[str]):
    lock, _ = Lock.load(os.path.join(run_dir, "lock.yaml"))
    with open(os.path.join(run_dir, "profile.json")) as f:
        calls = {p["point"]: p["calls_by_kind"] for p in json.load(f)["points"]}
    candidates = {point: [_locked(lock, point)]
                  + [(f"{point}:{name} {c}", variants(point)[name], c)
                     for name in FUSIONS[point] for c in variants(point)[name].tuning_configs()]
                  for point in points}
    rows_out = []
    for point, cands in candidates.items():
        counts = calls["attention"] if point == "attention_out" else {"sliding": sum(calls[point].values())}
        for round_ in (1, 2):
            for label, variant, config in cands:
                step_us, spread = 0.0, 0.0
                for kind, n in counts.items():
                    wl = Workload(PRESET, batch=1, context=4096, layer=kind, dtype="bf16")
                    t = bench.time_variant(variant, wl, device=DEVICE, config=config)
                    step_us += n * t["median_us"]
                    spread = max(spread, t["spread"])
                rows_out.append({"point": point, "round": round_, "candidate": label, "step_us": round(step_us, 1),
                                 "spread": spread})
                print(f"{point:14s} round {round_}  {step_us:8.1f} us/step  spread {spread:.1%}  {label}", flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    with open(out_path, "w") as f:
        json.dump({"command": "python3 scripts/gpu_decode_fusions.py " + " ".join(sys.argv[1:]),
                   "device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, "preset": PRESET,
                   "torch": torch.__version__, "triton": triton.__version__,
                   "git_commit": commit, "calls_per_step": {p: calls[p] for p in ("attention", "experts")},
                   "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    args = sys.argv[1:]
    points = ["attention_out", "experts"]
    if "--points" in args:
        i = args.index("--points")
        args, points = args[:i], args[i + 1:]
    main(args[0] if len(args) > 1 else "runs/optimize-decode-b1-beam-501b-tp8", args[-1], points)
