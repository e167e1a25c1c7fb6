"""Profile one target step: time, kernels and roofline floor per fusion point; JSON + Perfetto trace."""

from __future__ import annotations

import os

from workbench.commands.common import DTYPES, print_json, resolve_device, resolve_dtype


def add_arguments(p) -> None:
    p.add_argument("--target", default="decode-b1", help="decode-b1, decode-b8, decode-b64 or prefill-8x2k")
    p.add_argument("--preset", default=None, help="model preset (default: beam-501b-tp8 on CUDA, beam-tiny on CPU)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--lock", default=None, help="profile the build a lock file selects (verified first)")
    p.add_argument("--force-lock", action="store_true",
                   help="profile a lock even if it fails verification (changed sources, another GPU)")
    p.add_argument("--out", default=None, help="folder for profile.json and profile.trace.json")
    p.add_argument("--from-trace", metavar="FILE",
                   help="only count a saved trace's kernels per layer and per point (.json or .json.gz; "
                        "--preset names the model it was taken on); runs nothing")
    p.add_argument("--json", action="store_true")


def run(args) -> int:
    if args.from_trace:
        from beam_model.config import BeamConfig
        from workbench.profiler.trace import load, summarize

        if not args.preset:
            raise ValueError("--from-trace needs --preset: the model the trace was taken on")
        print_json(summarize(load(args.from_trace), BeamConfig.from_preset(args.preset)))
        return 0
    from beam_model import BeamForCausalLM
    from workbench import bench
    from workbench.lock import load_for_serving
    from workbench.optimize import DTYPE_NAMES
    from workbench.profiler import profile_step
    from workbench.progress import profile_table
    from workbench.targets import StepRunner, for_device, get_target

    device = resolve_device(args.device)
    preset = args.preset or ("beam-501b-tp8" if device.type == "cuda" else "beam-tiny")
    dtype = resolve_dtype(args.dtype, device)
    # As `serve`: a lock whose sources changed would profile other code than it names.
    lock = load_for_serving(args.lock, force=args.force_lock, device=device) if args.lock else None
    model = BeamForCausalLM.from_preset(preset, dtype=dtype, device=device)
    if lock:
        model.set_variants(lock.selection, lock.configs)
    target = for_device(get_target(args.target), device)
    runner = StepRunner(model, target, use_graph=False)
    out = args.out or f"runs/profile-{args.target}-{preset}"
    os.makedirs(out, exist_ok=True)
    name = DTYPE_NAMES[dtype]
    profile = profile_step(runner, workload_for=lambda kind: target.workload(preset, name, kind),
                           ceilings=bench.measure_device_ceilings(device),
                           trace_path=os.path.join(out, "profile.trace.json"))
    data = profile.to_dict()
    import json

    with open(os.path.join(out, "profile.json"), "w") as f:
        json.dump(data, f, indent=2)
    if args.json:
        print_json(data)
    else:
        from rich.console import Console

        Console().print(profile_table(profile))
        Console().print(f"kernels per layer: {profile.kernels_per_layer}; wrote {out}/profile.json and the trace")
    return 0
