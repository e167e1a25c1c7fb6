"""Show, verify or gate a lock file, or compare several (`workbench lock show|verify|gate FILE`,
`workbench lock compare FILE FILE ...`).

`gate` runs the lock's build through the model gate on a model of your choice, e.g. the trained
beam-mini on held-out text (`--model models/beam-mini`): a build tuned on one model's shapes must
still give that model's answers. It judges the build's numerics, not the lock's provenance (`verify`).
`compare` times the locks' builds of one target in one process (`workbench.lock_compare`), e.g. the
BF16, FP8 and NVFP4 decode locks of a preset.
"""

from __future__ import annotations

from workbench.commands.common import print_json

# The two ragged prompts of `gate` on a trained model: long enough to cross its sliding window.
TEXT_PROMPT_TOKENS = 256


def add_arguments(p) -> None:
    p.add_argument("action", choices=("show", "verify", "gate", "compare"))
    p.add_argument("files", nargs="+", metavar="file", help="lock.yaml (compare: two or more)")
    p.add_argument("--no-gates", action="store_true", help="verify: hashes and environment only")
    p.add_argument("--device", default=None, help="device to run the gates or the steps on (default: cuda when "
                   "available)")
    p.add_argument("--model", metavar="DIR|PRESET",
                   help="gate: a checkpoint folder (prompted with held-out text when it has a tokenizer.json) "
                        "or a preset's random weights (default: the lock's preset); compare: the preset every "
                        "lock's model is built on, each in its lock's weight format (default: each lock's)")
    p.add_argument("--rounds", type=int, default=3, help="compare: rounds of timing every lock (default: 3)")
    p.add_argument("--budget", type=float, default=2.0, help="compare: timing seconds a lock a round (default: 2)")
    p.add_argument("--force-lock", action="store_true", help="compare: time locks that fail verification too")
    p.add_argument("--out", default=None, help="compare: folder for compare.json")
    p.add_argument("--prompt-tokens", type=int, default=TEXT_PROMPT_TOKENS,
                   help="gate: the longer text prompt's length (default: %(default)s)")
    p.add_argument("--decode-steps", type=int, default=8, help="gate: greedy steps after the prompts (default: 8)")
    p.add_argument("--json", action="store_true")


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from workbench.commands.common import resolve_device
    from workbench.lock import Lock, run_by, verify

    console = Console()
    if args.action == "compare":
        return compare(args, console)
    if len(args.files) != 1:
        raise ValueError(f"lock {args.action} takes one lock file, got {len(args.files)}")
    args.file = args.files[0]
    if args.action == "gate":
        return gate(args, console)
    if args.action == "show":
        lock, problems = Lock.load(args.file)
        if args.json:
            print_json({"lock": lock._body(), "problems": problems})
            return 0
        console.print(f"[bold]{args.file}[/]: target {lock.target}, model {lock.model}, created {lock.created}")
        console.print(f"environment: {lock.environment}")
        t = Table()
        for col in ("point", "variant", "backend", "source hash", "config", "us/step", "reference us/step"):
            t.add_column(col)
        members = run_by(lock.selection)
        for point, e in lock.points.items():
            timing = e.get("timing") or {}
            if point in members:  # its own selection never runs
                t.add_row(point, f"run by {members[point]}", "-", "-", "", "-",
                          f"{timing['reference_us']:.1f}" if "reference_us" in timing else "-")
                continue
            t.add_row(point, e["variant"], e.get("backend", "?"), str(e.get("source_hash")), str(e.get("config") or ""),
                      f"{timing['step_us']:.1f}" if "step_us" in timing else "-",
                      f"{timing['reference_us']:.1f}" if "reference_us" in timing else "-")
        console.print(t)
        for p in problems:
            console.print(f"[red]problem:[/] {p}")
        return 1 if problems else 0
    result = verify(args.file, run_gates=not args.no_gates, device=resolve_device(args.device))
    if args.json:
        print_json({"ok": result.ok, "problems": result.problems, "notes": result.notes, "gates": result.gate_reports})
        return 0 if result.ok else 1
    for n in result.notes:
        console.print(f"[yellow]note:[/] {n}")
    if result.ok:
        console.print(f"[green]{args.file} verifies[/]: sources, environment" + ("" if args.no_gates else ", gates"))
    else:
        for p in result.problems:
            console.print(f"[red]changed:[/] {p}")
    return 0 if result.ok else 1


def _gate_model(args, lock, device):
    """(model, prompts or None, what the model is): a checkpoint folder's model, on held-out text where it
    has a tokenizer, or a preset's random weights; None: the model gate's random ids."""
    import os

    from beam_model.model import BeamForCausalLM
    from workbench.dtypes import dtype_of

    dtype = dtype_of(lock.model.get("dtype", "bf16"))
    name = args.model or lock.model.get("preset", "beam-tiny")
    if not os.path.isdir(name):
        weights = lock.model.get("weights", "bf16") if name == lock.model.get("preset") else "bf16"
        return BeamForCausalLM.from_preset(name, dtype=dtype, device=device, weights=weights), None, \
            f"preset {name} (random weights)"
    if not os.path.isfile(os.path.join(name, "tokenizer.json")):
        return BeamForCausalLM.from_pretrained(name, dtype=dtype, device=device), None, f"{name} (random ids)"
    from beam_model.tokenizer import load_tokenizer
    from workbench.gates import ragged_lengths
    from workbench.training.data import held_out_batch

    lengths = ragged_lengths(args.prompt_tokens)
    text = held_out_batch(load_tokenizer(name), 2, lengths[0])
    prompts = [row[:n] for row, n in zip(text, lengths)]
    model = BeamForCausalLM.from_pretrained(name, dtype=dtype, device=device)
    return model, (prompts, "held-out text"), f"{name} (held-out text)"


def gate(args, console) -> int:
    from workbench.agent.candidates import close_sandboxed, sandbox_count
    from workbench.commands.common import resolve_device
    from workbench.lock import Lock

    lock, problems = Lock.load(args.file)
    device = resolve_device(args.device)
    keep = sandbox_count()
    try:
        return _gate(args, console, lock, problems, device)
    finally:
        close_sandboxed(keep)  # the sandboxes of variants from outside the package


def _gate(args, console, lock, problems, device) -> int:
    from rich.table import Table

    from workbench.gates import model_gate
    from workbench.lock import register_outside_source
    from workbench.provenance import environment
    from workbench.registry import POINTS

    selection, renamed = lock.current_selection()
    notes = [f"{p} (the gate runs the build all the same)" for p in problems] + renamed
    for point, variant in selection.items():
        if point in POINTS:  # an agent's accepted file: its code runs in a sandbox, never imported here
            register_outside_source(point, {**lock.points[point], "variant": variant}, sandboxed=True, device=device)
    model, prompts, what = _gate_model(args, lock, device)
    report = model_gate(model, selection, configs=lock.configs, decode_steps=args.decode_steps, prompts=prompts)
    if args.json:
        print_json({"lock": args.file, "target": lock.target, "locked_model": lock.model, "model": what,
                    "device": str(device), "passed": report.passed, "notes": notes, "report": report.to_dict(),
                    "environment": environment()})
        return 0 if report.passed else 1
    for n in notes:
        console.print(f"[yellow]note:[/] {n}")
    t = Table(title=f"model gate of {args.file} on {what}")
    for col in ("check", "passed", "error / threshold", "detail"):
        t.add_column(col)
    for c in report.checks:
        measured = f"{c.error:.3g} / {c.threshold:.3g}" if c.error is not None and c.threshold is not None else ""
        t.add_row(c.name, "[green]yes[/]" if c.passed else "[bold red]no[/]", measured, c.detail)
    console.print(t)
    console.print(f"[green]passes[/] on {what}" if report.passed else f"[red]fails[/]: {report.first_failure()}")
    return 0 if report.passed else 1


def compare(args, console) -> int:
    import os

    import torch
    from rich.table import Table

    from workbench.commands.common import given_command, resolve_device, write_and_print
    from workbench.lock_compare import compare_locks
    from workbench.provenance import environment

    if len(args.files) < 2:
        raise ValueError("lock compare takes two or more lock files")
    device = resolve_device(args.device)
    if args.model and os.path.isdir(args.model):
        raise ValueError("lock compare builds random weights: --model names a preset, not a checkpoint folder")

    def timed(path, r, us):
        if not args.json:
            console.print(f"round {r + 1}: {path} {us:.1f} us")

    result = compare_locks(args.files, preset=args.model, rounds=args.rounds, budget_s=args.budget, device=device,
                           force=args.force_lock, on_timed=timed)
    result = {"command": given_command(args), **result, "environment": environment(),
              **({"gpu": torch.cuda.get_device_name(device)} if device.type == "cuda" else {})}
    if write_and_print(args, "compare.json", result):
        return 0
    t = Table(title=f"{result['target']} on {result.get('gpu', device)}, median of {args.rounds} rounds")
    for col in ("lock", "preset", "weights", "step us", "over the first"):
        t.add_column(col)
    for row in result["locks"]:
        t.add_row(row["lock"], str(row["preset"]), row["weights"], f"{row['median_us']:.1f}",
                  f"{row['over_first']:.3f}")
    console.print(t)
    for row in result["locks"]:
        for note in row["notes"]:
            console.print(f"[yellow]note:[/] {row['lock']}: {note}")
        for problem in row["forced_past"]:
            console.print(f"[yellow]forced past:[/] {row['lock']}: {problem}")
    return 0
