"""Rewrite a finished optimize run's report.md and report.json in the current format (`workbench report DIR`).

Fields derived from the run's own search results (`search/*.json`), such as each backend's fastest
candidate per point, are recomputed; every timing stays the one the run measured. Nothing is timed,
gated or locked again.
"""

from __future__ import annotations

import os


def add_arguments(p) -> None:
    p.add_argument("dir", help="an optimize run folder (holding report.json and search/)")


def run(args) -> int:
    from workbench.report import rerender

    if not os.path.isfile(os.path.join(args.dir, "report.json")):
        print(f"workbench report: {args.dir} has no report.json (not a finished optimize run)")
        return 2
    rerender(args.dir)
    print(f"wrote {os.path.join(args.dir, 'report.md')} and report.json")
    return 0
