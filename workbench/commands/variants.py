"""List every fusion point's variants, their backend and whether they can run on this machine (and why not).

Availability is the backend's library being importable, then the variant's own `supports`
predicate at the given preset's decode shapes on the given device; a variant quarantined on that
device (workbench/quarantine.py) is listed as unavailable with the evidence. Only reads the registry.
"""

from __future__ import annotations

import os

from workbench.commands.common import print_json, resolve_device


def add_arguments(p) -> None:
    p.add_argument("action", nargs="?", choices=("list",), default="list", help="what to do (default: list)")
    p.add_argument("--preset", default="beam-501b-tp8", help="shapes given to supports() (default: %(default)s)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _relative(path: str) -> str:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.relpath(path, root) if path.startswith(root + os.sep) else path


def listing(preset: str, device) -> list[dict]:
    from workbench import registry
    from workbench.points import Workload, spec
    from workbench.quarantine import quarantined

    out = []
    for point in registry.POINTS:
        table = registry.variants(point)
        try:
            spec(point)
            has_spec = True
        except KeyError:
            has_spec = False
        rows = []
        for name, v in table.items():
            # attention and qk_prep differ by layer kind: a variant is available if it supports either
            why_not = [v.unsupported(Workload(preset=preset, layer=layer), device) for layer in ("sliding", "full")]
            held = quarantined(point, name, device)  # runs, but searches leave it out
            ok = not all(why_not) and not held
            rows.append({"name": name, "backend": v.backend, "reference": name == registry.REFERENCE,
                         "available": ok, "reason": "ok" if ok else held or why_not[0],
                         "weight_transform": v.prepare is not None, "configs": len(v.configs),
                         # the weight formats it reads, where its point's weights may be quantized
                         "weights": list(v.formats) if has_spec and spec(point).quantized else None,
                         "source": _relative(v.source_file)})
        out.append({"point": point, "spec": has_spec, "variants": rows})
    return out


def run(args) -> int:
    device = resolve_device(args.device)
    points = listing(args.preset, device)
    if args.json:
        print_json({"device": str(device), "preset": args.preset, "points": points})
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Variants (availability on {device}, {args.preset} shapes)")
    for col in ("point", "variant", "backend", "available", "notes"):
        table.add_column(col)
    for p in points:
        for i, v in enumerate(p["variants"]):
            notes = [] if v["available"] else [v["reason"]]
            notes += ["reference"] * v["reference"] + ["weight layout"] * v["weight_transform"]
            notes += [f"{v['configs']} configs"] * bool(v["configs"])
            if v["weights"] not in (None, ["bf16"]):
                notes.append(f"reads {'/'.join(v['weights'])} weights")
            if i == 0 and not p["spec"]:
                notes.append("no PointSpec: cannot be benched or gated yet")
            table.add_row(p["point"] if i == 0 else "", v["name"], v["backend"],
                          "[green]yes[/]" if v["available"] else "[red]no[/]", ", ".join(notes))
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 140)  # logs and pipes: keep a row on one line
    console.print(table)
    return 0
