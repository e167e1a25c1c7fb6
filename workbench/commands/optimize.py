"""Profile a target, search the variants under the gates, lock the winning set and report."""

from __future__ import annotations

import signal
import sys

from workbench.commands.common import (
    add_weights_argument,
    add_worker_arguments,
    given_command,
    print_json,
    resolve_device,
    resolve_dtype,
    worker_limits,
)
from workbench.dtypes import DTYPES
from workbench.registry import POINTS

STOPPED = 3  # exit status of a run that spent its --budget before the search finished
STOPPED_FROM_OUTSIDE = 130  # Ctrl-C or SIGTERM, as a shell reports a process ended by SIGINT


def add_arguments(p) -> None:
    from workbench.agent.loop import AgentOptions
    from workbench.end_to_end import STEP_SAMPLES_S

    p.add_argument("--target", default="decode-b1",
                   help="decode-b1, decode-b8, decode-b64, prefill-8x2k, verify-b1, verify-b8 or draft-b1")
    p.add_argument("--preset", default=None, help="model preset (default: beam-501b-tp8 on CUDA, beam-tiny on CPU)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    add_weights_argument(p, what="the projections", default="bf16")
    p.add_argument("--out", default=None, help="run folder (default: runs/optimize-<target>-<preset>[-<weights>])")
    p.add_argument("--points", nargs="+", choices=POINTS, default=list(POINTS), help="points to search")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--budget", type=float, metavar="SECONDS",
                   help="start no new point's search after this long; the same command resumes the run")
    p.add_argument("--backends", nargs="+", metavar="B",
                   help="try only these backends' candidates, e.g. triton (default: all; the torch.compile "
                        "baseline of the report is timed regardless); one that cannot run here stops the run "
                        "before it starts")
    p.add_argument("--candidate-timeout", type=float, default=900.0, metavar="SECONDS",
                   help="end the run when one candidate's gate + timing takes longer (a hung kernel), not counting "
                        "compiler processes it runs (a JIT build, up to 30 min); the same command resumes and skips "
                        "it (default: %(default)s; 0: no limit)")
    p.add_argument("--compile-baseline", nargs="+", default=["points"], metavar="MODE",
                   choices=("points", "default", "max-autotune-no-cudagraphs", "plain-default",
                            "plain-max-autotune-no-cudagraphs", "none"),  # the step is graphed already
                   help="the report's torch.compile builds, a row each: 'points' (each point's torch_compile "
                        "variant, default) and/or a torch.compile mode for the whole reference step, e.g. "
                        "max-autotune-no-cudagraphs (compiles the whole model: minutes at full size), and/or "
                        "'plain-' and a mode: the whole step compiled from each point's fastest gated plain-PyTorch "
                        "variant (a packed projection, say), as a careful user compiles the model; 'none': no "
                        "torch.compile row (the report then has no baseline but the reference)")
    p.add_argument("--in-step", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                   help="after the lock, time the locked step with each point replaced by a stand-in that launches "
                        "no kernel: each point's cost in the step as it runs, a report column (in_step.json); "
                        "SECONDS of samples per timing (default %(const)s)")
    p.add_argument("--step-seconds", type=float, default=STEP_SAMPLES_S, metavar="SECONDS",
                   help="seconds of samples per build timing in the end-to-end stage (a paired timing's rounds take "
                        "no more together); more steadies a noisy device's decisions (default: %(default)s)")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="lock for N tensor-parallel ranks (the preset is one rank's shapes, as beam-501b-tp8 is): "
                        "boundary candidates also pass the rank gate on N processes, and the reference and locked "
                        "steps are timed on N ranks at once, the slowest rank's time counting (NCCL with a GPU "
                        "each, else gloo); default: %(default)s")
    p.add_argument("--force", action="store_true",
                   help="write over the run folder's lock even when this run cannot search some of its choices "
                        "(a backend missing here or left out of --backends, a point left out of --points)")
    p.add_argument("--trust", action="store_true", help="lock speed-ups beyond the roofline (flagged otherwise)")
    p.add_argument("--agent", metavar="CMD", help="after the search, run `CMD TASK_DIR` for the points with the "
                   "most headroom and judge the variant it leaves there (see AGENTS.md)")
    p.add_argument("--rounds", type=int, default=3, help="agent rounds per point (default: %(default)s)")
    p.add_argument("--agent-budget", type=float, default=900.0, metavar="SECONDS",
                   help="wall-clock budget of one agent run (default: %(default)s)")
    p.add_argument("--agent-points", type=int, default=1, metavar="N",
                   help="how many points, most headroom first, get agent rounds (default: %(default)s)")
    defaults = AgentOptions("")
    add_worker_arguments(p, what="judges each agent variant (--agent)", timeout_s=defaults.worker_timeout_s,
                         mem_bytes=defaults.worker_mem_bytes)
    p.add_argument("--json", action="store_true", help="print the final report as JSON")
    p.add_argument("--tui", action="store_true", help="watch and steer the run in the terminal UI")


def _agent(args):
    if not getattr(args, "agent", None):
        return None
    from workbench.agent.loop import AgentOptions

    if args.rounds < 1 or args.agent_points < 1:
        raise ValueError("--rounds and --agent-points must be at least 1")
    limits = worker_limits(args)
    return AgentOptions(args.agent, rounds=args.rounds, budget_s=args.agent_budget, points=args.agent_points,
                        worker_timeout_s=limits["timeout"] or 0.0, worker_mem_bytes=limits["mem_bytes"])


def run(args) -> int:
    from workbench.optimize import OptimizeOptions

    device = resolve_device(args.device)
    preset = args.preset or ("beam-501b-tp8" if device.type == "cuda" else "beam-tiny")
    dtype = resolve_dtype(args.dtype, device)
    folder = f"runs/optimize-{args.target}-{preset}" + ("" if args.weights == "bf16" else f"-{args.weights}") + \
        ("" if args.tp == 1 else f"-x{args.tp}")
    opts = OptimizeOptions(target=args.target, preset=preset, dtype=dtype, device=device, weights=args.weights,
                           out_dir=args.out or folder, seed=args.seed,
                           points=tuple(args.points), trust=args.trust, budget_s=args.budget,
                           backends=tuple(args.backends) if args.backends else None, agent=_agent(args),
                           candidate_timeout=args.candidate_timeout or None, force=args.force,
                           compile_baselines=tuple(m for m in dict.fromkeys(args.compile_baseline) if m != "none"),
                           in_step_s=args.in_step, tp=args.tp, step_samples_s=args.step_seconds,
                           command=given_command(args))
    if args.tui:
        from workbench.tui import WorkbenchApp

        WorkbenchApp(opts, start_search=True).run()
        return 0
    # A time limit's SIGTERM (`timeout`, a batch scheduler) stops the run as Ctrl-C does: the candidate
    # in flight is recorded as stopped, not hung, and the next run tries it again (inflight.STOPS_TRIED).
    # A judge's worker or an agent command in flight is ended first, with all it started (worker.hold_signals).
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return _run(opts, args.json)
    except KeyboardInterrupt:
        print(f"\nworkbench optimize: stopped. Run the same command to resume from {opts.out_dir}.",
              file=sys.stderr, flush=True)
        return STOPPED_FROM_OUTSIDE
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(opts, as_json: bool) -> int:
    from workbench.optimize import optimize

    if as_json:
        report = optimize(opts)
        print_json(report)
        return STOPPED if report.get("stopped") else 0
    from workbench.progress import ConsoleProgress

    with ConsoleProgress() as progress:
        report = optimize(opts, on_event=progress.event)
    if report.get("stopped"):
        progress.stopped(report)
        return STOPPED
    progress.summary(report, opts.out_dir)
    return 0
