"""`workbench` command line: one subcommand per module under `workbench/commands/`.

Each command module has a docstring (its help text), `add_arguments(parser)` and `run(args) -> int`.
Modules are imported only when their command runs, so `workbench --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "info": "workbench.commands.info",
    "generate": "workbench.commands.generate",
    "check": "workbench.commands.check",
    "optimize": "workbench.commands.optimize",
    "profile": "workbench.commands.profile",
    "lock": "workbench.commands.lock",
    "report": "workbench.commands.report",
    "bench": "workbench.commands.bench",
    "variants": "workbench.commands.variants",
    "variant": "workbench.commands.variant",
    "serve": "workbench.commands.serve",
    "tui": "workbench.commands.tui",
    "tokenizer": "workbench.commands.tokenizer",
    "train": "workbench.commands.train",
    "train-drafter": "workbench.commands.train_drafter",
    "verify-cost": "workbench.commands.verify_cost",
    "quantize": "workbench.commands.quantize",
}


def _help_line(module: str) -> str:
    doc = importlib.import_module(module).__doc__ or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench", description="Beam kernel optimization workbench")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        if command in (None, name):
            mod = importlib.import_module(module)
            p = sub.add_parser(name, help=_help_line(module), description=mod.__doc__)
            mod.add_arguments(p)
        else:
            sub.add_parser(name, help=_help_line(module), add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    args.argv = list(argv)  # the records commands write name the command as given (`common.given_command`)
    if not args.command:
        parser.print_help()
        return 0
    try:
        return importlib.import_module(COMMANDS[args.command]).run(args) or 0
    except (ValueError, KeyError, FileNotFoundError, RuntimeError) as e:
        from rich.console import Console

        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        Console(stderr=True).print(f"[bold red]error:[/] {msg}", highlight=False)
        return 2


if __name__ == "__main__":
    sys.exit(main())
