"""Open the terminal UI: watch and steer a profile, a search and a lock from the keyboard.

`workbench tui` opens an empty session (r profiles the target, g starts a search with the options
below); `--run DIR` shows a finished run folder (its profile, every point's search results and its
lock, under the device the run was measured on; g then resumes that run here); `--lock FILE` opens
a lock; `--start` starts the search at once (`workbench optimize --tui` does the same). Press ? in
the app for every key.
"""

from __future__ import annotations

import os

from workbench.commands.common import given_command, resolve_device, resolve_dtype
from workbench.dtypes import DTYPES
from workbench.registry import POINTS


def add_arguments(p) -> None:
    p.add_argument("--run", metavar="DIR", help="open a finished run folder: profile.json, search/, report.json, "
                                                "lock.yaml (shown under the device the run was measured on)")
    p.add_argument("--lock", metavar="FILE", help="open a lock file in the Lock view")
    p.add_argument("--start", action="store_true", help="start the search at once")
    p.add_argument("--target", default=None, help="decode-b1, decode-b8, decode-b64, prefill-8x2k, verify-b1, "
                                                  "verify-b8 or draft-b1 (default: the run's, else decode-b1)")
    p.add_argument("--preset", default=None, help="model preset (default: the run's, else beam-501b-tp8 on CUDA, "
                                                  "beam-tiny on CPU)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: the run's, else bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--out", default=None, help="run folder of a search (default: --run, else "
                                               "runs/optimize-<target>-<preset>)")
    p.add_argument("--points", nargs="+", choices=POINTS, default=list(POINTS), help="points to search")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--trust", action="store_true", help="lock speed-ups beyond the roofline (flagged otherwise)")
    p.add_argument("--force", action="store_true", help="let a search write over the run folder's lock even when "
                                                        "it cannot search some of that lock's choices")


def options(args):
    """The search a `g` in the app starts: the optimize options, defaulting to the opened run's own."""
    from workbench.optimize import OptimizeOptions
    from workbench.tui.run_files import read_run

    saved = read_run(args.run) if args.run else None  # so that g resumes the run: same target, preset, dtype
    device = resolve_device(args.device)
    target = args.target or (saved and saved.target) or "decode-b1"
    preset = args.preset or (saved and saved.preset) or ("beam-501b-tp8" if device.type == "cuda" else "beam-tiny")
    dtype = resolve_dtype(args.dtype or (saved.dtype if saved and saved.dtype in DTYPES else None), device)
    return OptimizeOptions(target=target, preset=preset, dtype=dtype, device=device,
                           out_dir=args.out or args.run or f"runs/optimize-{target}-{preset}", seed=args.seed,
                           points=tuple(args.points), trust=args.trust, force=args.force,
                           command=given_command(args))


def run(args) -> int:
    from workbench.tui import WorkbenchApp

    if args.run and not os.path.isdir(args.run):
        raise FileNotFoundError(f"no run folder at {args.run}")
    WorkbenchApp(options(args), run_dir=args.run, lock_path=args.lock, start_search=args.start).run()
    return 0
