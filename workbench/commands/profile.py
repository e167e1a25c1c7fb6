"""Profile one target step: time, kernels and roofline floor per fusion point; JSON + Perfetto trace."""

from __future__ import annotations

import os

from workbench.commands.common import add_weights_argument, print_json, resolve_device, resolve_dtype
from workbench.dtypes import DTYPES, name_of
from workbench.run_folder import write_json


def add_arguments(p) -> None:
    p.add_argument("--target", default="decode-b1",
                   help="decode-b1, decode-b8, decode-b64, prefill-8x2k, verify-b1, verify-b8 or draft-b1")
    p.add_argument("--preset", default=None, help="model preset (default: beam-501b-tp8 on CUDA, beam-tiny on CPU)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--device", default=None)
    add_weights_argument(p, what="the projections")
    p.add_argument("--lock", default=None, help="profile the build a lock file selects (verified first)")
    p.add_argument("--force-lock", action="store_true",
                   help="profile a lock even if it fails verification (changed sources, another GPU)")
    p.add_argument("--out", default=None, help="folder for profile.json and profile.trace.json")
    p.add_argument("--from-trace", metavar="FILE",
                   help="only count a saved trace's kernels per layer and per point (.json or .json.gz; "
                        "--preset names the model it was taken on); runs nothing")
    p.add_argument("--in-step", action="store_true",
                   help="then time the step as the server runs it (graphed decode, PDL) against the same step "
                        "with each point the model calls replaced by a stand-in that launches no kernel: each "
                        "point's cost in the step, overlap included, and the most a fusion of it could save "
                        "(in_step.json)")
    p.add_argument("--in-step-group", action="append", default=[], metavar="P,Q,...",
                   help="with --in-step: also stand in for these points together (repeatable)")
    p.add_argument("--in-step-seconds", type=float, default=2.0,
                   help="with --in-step: seconds of samples per step timing (each build is timed twice)")
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="time the step on N tensor-parallel ranks at once instead (one process each; NCCL with a "
                        "GPU per rank, else gloo): the preset is one rank's shapes, every boundary all-reduces "
                        "over the N ranks, and the slowest rank's median counts (tp_step.json; no per-point "
                        "attribution). --tp 1 runs the step as the one rank of an NCCL group, beside the same "
                        "step without one (a group of one reduces nothing, so no collective runs)")
    p.add_argument("--reps", type=int, default=None, help="with --tp: timed steps on every rank (default: 50)")
    p.add_argument("--json", action="store_true")


def run(args) -> int:
    if args.from_trace:
        from beam_model.config import BeamConfig
        from workbench.profiler.attribution import summarize
        from workbench.profiler.trace import load

        if not args.preset:
            raise ValueError("--from-trace needs --preset: the model the trace was taken on")
        print_json(summarize(load(args.from_trace), BeamConfig.from_preset(args.preset)))
        return 0
    from beam_model import BeamForCausalLM
    from workbench.lock import load_for_serving
    from workbench.profiler import profile_step
    from workbench.profiler.in_step import check_groups
    from workbench.progress import profile_table
    from workbench.roofline import measure_device_ceilings
    from workbench.targets import StepRunner, for_device, get_target

    groups = check_groups(args.in_step_group)  # before anything runs
    if groups and not args.in_step:
        raise ValueError("--in-step-group needs --in-step")
    device = resolve_device(args.device)
    preset = args.preset or ("beam-501b-tp8" if device.type == "cuda" else "beam-tiny")
    dtype = resolve_dtype(args.dtype, device)
    # As `serve`: a lock whose sources changed would profile other code than it names.
    lock = load_for_serving(args.lock, force=args.force_lock, device=device) if args.lock else None
    weights = args.weights or (lock.model.get("weights", "bf16") if lock else "bf16")
    if args.tp is not None:
        return _tp_step(args, preset, name_of(dtype), weights, lock, device)
    if args.reps is not None:
        raise ValueError("--reps times a --tp step")
    model = BeamForCausalLM.from_preset(preset, dtype=dtype, device=device, weights=weights)
    if lock:
        model.set_variants(lock.selection, lock.configs)
    target = for_device(get_target(args.target), device)
    runner = StepRunner(model, target, use_graph=False)
    out = args.out or f"runs/profile-{args.target}-{preset}"
    os.makedirs(out, exist_ok=True)
    name = name_of(dtype)
    profile = profile_step(runner, workload_for=lambda kind: target.workload(preset, name, kind, weights),
                           ceilings=measure_device_ceilings(device),
                           trace_path=os.path.join(out, "profile.trace.json"))
    data = profile.to_dict()
    write_json(os.path.join(out, "profile.json"), data)
    in_step = _in_step(args, model, target, lock, profile, device, groups, out) if args.in_step else None
    if args.json:
        print_json({**data, "in_step": in_step} if in_step else data)
        return 0
    from rich.console import Console

    Console().print(profile_table(profile))
    Console().print(f"kernels per layer: {profile.kernels_per_layer}; wrote {out}/profile.json and the trace")
    if in_step:
        from workbench.progress import in_step_table

        Console().print(in_step_table(in_step))
        Console().print(f"wrote {out}/in_step.json")
    return 0


def _in_step(args, model, target, lock, profile, device, groups, out) -> dict:
    """Each point's cost in the step as it runs (`workbench.profiler.in_step`), beside its floor from
    `profile`; written to in_step.json."""

    from workbench.profiler.in_step import in_step_costs
    from workbench.targets import StepRunner

    selection, configs = (lock.selection, lock.configs) if lock else (model.ops.selection, {})
    graphed = StepRunner(model, target)  # as the server runs it: a CUDA graph at decode on the GPU
    quiet = (lambda line: None) if args.json else print
    result = in_step_costs(graphed, selection, configs, groups=groups, device=device,
                           budget_s=args.in_step_seconds, log=quiet)
    floors = {p.point: p.floor_us / 1e3 for p in profile.points if p.floor_us}
    for label, cost in result["costs"].items():
        members = label.split("+")
        cost["variants"] = {p: selection.get(p, "torch") for p in members}
        cost["floor_ms"] = sum(floors.get(p, 0.0) for p in members)
    result.update(target=profile.target, preset=profile.preset, dtype=profile.dtype, device=profile.device,
                  graphed=graphed.graph is not None)
    write_json(os.path.join(out, "in_step.json"), result)
    return result


def _tp_step(args, preset, dtype, weights, lock, device) -> int:
    """`--tp N`: the step on N ranks at once (`workbench.tp_step`), written to tp_step.json."""
    from workbench.tp_step import DEFAULT_REPS, time_tp_step

    if args.in_step:
        raise ValueError("--in-step attributes one process's step; --tp times the ranks' step as a whole")
    result = time_tp_step(preset, args.target, args.tp, device_type=device.type, dtype=dtype, weights=weights,
                          selection=lock.selection if lock else None, configs=lock.configs if lock else None,
                          reps=args.reps or DEFAULT_REPS)
    out = args.out or f"runs/profile-{args.target}-{preset}-tp{args.tp}"
    os.makedirs(out, exist_ok=True)
    write_json(os.path.join(out, "tp_step.json"), result)
    if args.json:
        print_json(result)
        return 0
    for r in result["per_rank"]:
        print(f"rank {r['rank']}: median {r['median_ms']:.3f} ms (p10 {r['p10_ms']:.3f}, p90 {r['p90_ms']:.3f}) "
              f"over {r['reps']} steps on {r['device']}{', graphed' if r['graph'] else ''}")
        if "alone" in r:
            print(f"  without a group, alternating with it: median {r['alone']['median_ms']:.3f} ms; "
                  f"with / without, round by round: {r['paired_ratio']:.3f}")
    print(f"{args.target} on {args.tp} ranks of {preset} ({result['backend']}): {result['step_ms']:.3f} ms a step "
          f"(rank {result['slowest_rank']}, the slowest); wrote {out}/tp_step.json")
    return 0
