"""Show or verify a lock file (`workbench lock show|verify FILE`)."""

from __future__ import annotations

from workbench.commands.common import print_json


def add_arguments(p) -> None:
    p.add_argument("action", choices=("show", "verify"))
    p.add_argument("file", help="lock.yaml")
    p.add_argument("--no-gates", action="store_true", help="verify hashes and environment only")
    p.add_argument("--device", default=None, help="device to re-run the gates on (default: cuda when available)")
    p.add_argument("--json", action="store_true")


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from workbench.commands.common import resolve_device
    from workbench.lock import Lock, run_by, verify

    console = Console()
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
