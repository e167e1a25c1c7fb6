"""Time speculative decoding's verify step for 1..N tokens against the one-token decode step; project the speed-up
(`--from FILE`: project again from a verify_cost.json this command wrote, timing nothing)."""

from __future__ import annotations

import os

from workbench.commands.common import (
    add_weights_argument,
    given_command,
    resolve_device,
    resolve_dtype,
    write_and_print,
)
from workbench.dtypes import DTYPES, name_of

# The public launches' tokens per verify step (../shared/docs/sources: agentic workload at temperature
# 1.0, and low-entropy code), the default acceptance lengths projected
PUBLISHED_ACCEPTANCE = (3.4, 3.7)


def add_arguments(p) -> None:
    p.add_argument("--preset", default=None, help="model preset (default: beam-501b-tp8 on CUDA, beam-tiny on CPU)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    add_weights_argument(p, what="the preset's projections", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--lock", default=None, help="time the build a lock file selects (verified first)")
    p.add_argument("--force-lock", action="store_true", help="time a lock even if it fails verification")
    p.add_argument("--tokens", type=int, default=16, help="time steps of 1 .. TOKENS tokens (default: %(default)s)")
    p.add_argument("--context", type=int, default=None, help="KV tokens before the step (default: 4096; 96 on CPU)")
    p.add_argument("--overlap", type=float, action="append", default=None, metavar="SHARE",
                   help="also time with every token sharing this fraction of its experts (repeatable; beam-mini's "
                        "held-out text: 0.35)")
    p.add_argument("--drafter-layers", type=int, default=5,
                   help="layers of the random drafter whose block step is timed (default: %(default)s)")
    p.add_argument("--acceptance", type=float, nargs="+", default=list(PUBLISHED_ACCEPTANCE),
                   help="tokens per verify step to project the speed-up at (default: %(default)s)")
    p.add_argument("--budget", type=float, default=2.0, help="timing seconds per step size (default: %(default)s)")
    p.add_argument("--from", dest="from_file", default=None, metavar="FILE",
                   help="time nothing: project the speed-up at --acceptance from FILE (a verify_cost.json), into "
                        "projection.json")
    p.add_argument("--draft-us", type=float, default=None, metavar="US",
                   help="with --from: project with a draft step of US microseconds instead of the file's (0: the "
                        "most the verify step's cost allows, as if drafting were free)")
    p.add_argument("--out", default=None, help="folder for verify_cost.json (with --from: projection.json)")
    p.add_argument("--json", action="store_true")


def projections(curves_us: dict[str, dict[int, float]], draft_us: float, acceptance: list[float]) -> dict:
    """The speed-up at each acceptance length with every draft verified (`projected_speedup`), and with the
    number of drafts that pays best (`projected_best_drafts`, `verify_cost.best_fixed_drafts`), per curve."""
    from workbench.verify_cost import best_fixed_drafts, projected_speedup

    def each(fn):
        return {name: {f"{a:g}": fn(curve, draft_us, a, max(curve) - 1) for a in acceptance}
                for name, curve in curves_us.items()}
    return {"projected_speedup": each(projected_speedup), "projected_best_drafts": each(best_fixed_drafts)}


def _print_projections(result: dict) -> None:
    for name, speedups in result["projected_speedup"].items():
        print(f"{name}: projected speed-up at " + ", ".join(f"{a} tokens per verify step: {s:.2f}x"
                                                             for a, s in speedups.items()))
        best = result["projected_best_drafts"][name]
        print("  verifying the drafts that pay best: " + ", ".join(
            f"at {a}: {b['drafts']} drafts, {b['speedup']:.2f}x" for a, b in best.items())
              + ("" if any(b["speedup"] > 1 for b in best.values()) else " (none pays: plain decoding is faster)"))


def _from_file(args) -> int:
    import json

    with open(args.from_file) as f:
        saved = json.load(f)
    try:
        curves = {name: {int(n): c["median_us"] for n, c in curve.items()} for name, curve in saved["curves"].items()}
        draft_us = saved["draft_step_us"] if args.draft_us is None else args.draft_us
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{args.from_file} is not a verify_cost.json this command wrote ({e!r})") from None
    if draft_us < 0:
        raise ValueError(f"--draft-us must be 0 or more, got {draft_us}")
    result = {"command": given_command(args), "from": args.from_file, "acceptance": args.acceptance,
              "draft_step_us": draft_us, **projections(curves, draft_us, args.acceptance)}
    if write_and_print(args, "projection.json", result):
        return 0
    _print_projections(result)
    return 0


def run(args) -> int:
    if args.from_file:
        return _from_file(args)
    if args.draft_us is not None:
        raise ValueError("--draft-us projects from a file: give --from FILE too")
    import platform

    import torch

    from beam_model import BeamForCausalLM
    from beam_model.drafter_config import DrafterConfig
    from workbench.lock import load_for_serving
    from workbench.training.drafter import converted, initial_drafter
    from workbench.verify_cost import draft_step_us, verify_curve

    device = resolve_device(args.device)
    preset = args.preset or ("beam-501b-tp8" if device.type == "cuda" else "beam-tiny")
    dtype = resolve_dtype(args.dtype, device)
    context = args.context or (4096 if device.type == "cuda" else 96)
    if not 2 <= args.tokens <= 64:
        raise ValueError(f"--tokens must be in 2..64, got {args.tokens}")
    lock = load_for_serving(args.lock, force=args.force_lock, device=device) if args.lock else None
    weights = args.weights or (lock.model.get("weights", "bf16") if lock else "bf16")
    model = BeamForCausalLM.from_preset(preset, dtype=dtype, device=device, weights=weights)
    if lock:
        model.set_variants(lock.selection, lock.configs)
    sizes = list(range(1, args.tokens + 1))
    curves = {"random": verify_curve(model, sizes, context=context, budget_s=args.budget)}
    for share in args.overlap or []:
        curves[f"overlap_{share:g}"] = verify_curve(model, sizes, context=context, overlap=share, budget_s=args.budget)
    config = DrafterConfig.for_target(model.config, num_hidden_layers=args.drafter_layers, block_size=args.tokens)
    drafter = converted(initial_drafter(config, model, seed=0, device=device), dtype)
    draft = draft_step_us(drafter, context=context, budget_s=args.budget)
    result = {
        "command": given_command(args), "preset": preset, "dtype": name_of(dtype),
        "weights": weights, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else f"{platform.machine()} ({os.cpu_count()} cores)", "torch": torch.__version__,
        "selection": model.ops.selection, "context": context, "drafter_layers": args.drafter_layers,
        "draft_step_us": draft["median_us"],
        "curves": {name: {str(n): {"median_us": r["median_us"], "spread": r["spread"],
                                   "over_decode": r["median_us"] / curve[1]["median_us"]} for n, r in curve.items()}
                   for name, curve in curves.items()},
        **projections({name: {n: r["median_us"] for n, r in curve.items()} for name, curve in curves.items()},
                      draft["median_us"], args.acceptance),
    }
    if write_and_print(args, "verify_cost.json", result):
        return 0
    for name, curve in result["curves"].items():
        print(f"{name}: " + ", ".join(f"{n}: {c['median_us']:.0f} us ({c['over_decode']:.2f}x)"
                                      for n, c in curve.items()))
    _print_projections(result)
    print(f"draft step ({args.drafter_layers} layers, block {args.tokens}): {draft['median_us']:.0f} us")
    return 0
