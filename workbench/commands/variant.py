"""Scaffold a new variant of a fusion point: `workbench variant new POINT --backend B --name NAME`.

Writes `workbench/variants/<point>/<name>.py` (picked up by the registry), or `<point>__<name>.py` into a
plugin directory given by --dir (then pass the same --dir to `check` and `bench`). The module holds
the point's contract, the shapes of the target, and the reference computation inlined, registered
as NAME: `workbench check NAME` passes on it as written. Never overwrites a file without --force.
"""

from __future__ import annotations

from workbench.commands.common import print_json
from workbench.dtypes import DTYPES


def add_arguments(p) -> None:
    p.add_argument("action", choices=("new",), help="what to do")
    p.add_argument("point", metavar="POINT", help="fusion point, e.g. boundary, head")
    p.add_argument("--backend", choices=("torch", "triton", "cute"), default="torch",
                   help="the variant's backend (default: %(default)s)")
    p.add_argument("--name", required=True, help="variant name, lower_snake_case")
    p.add_argument("--dir", metavar="DIR", help="plugin directory to write to (default: workbench/variants/)")
    p.add_argument("--target", default="decode-b1",
                   help="target whose shapes go in the docstring (default: %(default)s)")
    p.add_argument("--preset", default=None, help="preset of those shapes (default: beam-501b-tp8 on CUDA, "
                   "beam-tiny on CPU)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bf16")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args) -> int:
    from workbench.agent import scaffold
    from workbench.commands.common import resolve_device
    from workbench.points import step_kinds
    from workbench.registry import POINTS
    from workbench.targets import for_device, get_target

    if args.point not in POINTS:
        raise KeyError(f"unknown fusion point {args.point!r}; points: {', '.join(POINTS)}")
    device = resolve_device(args.device)
    preset = args.preset or ("beam-501b-tp8" if device.type == "cuda" else "beam-tiny")
    target = for_device(get_target(args.target), device)
    workloads = {k: target.workload(preset, args.dtype or "bf16", k) for k in step_kinds(args.point)}
    shapes = scaffold.shapes_text(args.point, workloads)
    path = scaffold.write(args.point, args.name, args.backend, directory=args.dir, shapes=shapes, force=args.force)
    dir_flag = f" --dir {args.dir}" if args.dir else ""
    next_steps = [f"workbench check {args.name}{dir_flag}",
                  f"workbench bench {args.point} --variants {args.name}{dir_flag}"]
    if args.json:
        print_json({"path": path, "point": args.point, "variant": args.name, "backend": args.backend,
                    "plugin_dir": args.dir, "shapes": shapes, "next": next_steps})
    else:
        print(f"wrote {path}")
        for step in next_steps:
            print(f"  next: {step}")
    return 0
