"""What `workbench optimize` refuses before it writes anything to its run folder.

A run that cannot search what it is asked to, or that would replace a lock with a build searched
without that lock's choices, stops with the reason (a ValueError naming each problem and the way
out) before anything is written.

What it must never do: write to the run folder, or time or gate anything.
"""

from __future__ import annotations

import os

from workbench.lock import Lock, LockError
from workbench.registry import POINTS, REFERENCE, backend_available, get


def check_backends(backends: tuple[str, ...] | None) -> None:
    """Backends named for the search must all be able to run here. One that cannot (an unknown name, a
    library missing, no GPU) would have its variants skipped one by one and its locked choices dropped
    at the end-to-end stage, and a re-lock would write over the lock a build without them."""
    missing = [reason for ok, reason in map(backend_available, backends or ()) if not ok]
    if missing:
        raise ValueError("--backends names backends that cannot run here: " + "; ".join(missing)
                         + ". Install them, or leave them out of --backends")


def check_relock(out_dir: str, *, device, backends: tuple[str, ...] | None, points: tuple[str, ...],
                 force: bool) -> None:
    """A run in a folder holding a lock writes over it: refuse (unless forced) when this run cannot
    search one of that lock's choices (its backend missing here, left out of --backends, its point
    not searched, the variant gone). Otherwise the choice drops out and the lock written is a worse
    build (a decode re-lock on a host without FlashInfer would lock a far slower step)."""
    path = os.path.join(out_dir, "lock.yaml")
    if force or not os.path.exists(path):
        return
    try:
        lock, _ = Lock.load(path)
    except LockError as e:
        raise ValueError(f"{e}. This run would write over it: move it away, or pass --force") from None
    lost = []
    for point, entry in lock.points.items():
        if point not in POINTS or entry["variant"] == REFERENCE:
            continue
        try:
            v = get(point, entry["variant"])
        except KeyError:
            lost.append(f"{point}:{entry['variant']} (no longer registered)")
            continue
        why = (v.unsupported(device=device)
               or (f"backend {v.backend!r} left out of --backends" if backends and v.backend not in backends
                   else None)
               or (f"{point} is not among --points" if point not in points else None))
        if why:
            lost.append(f"{v.qualname} ({why})")
    if lost:
        raise ValueError(f"{path} locks choices this run cannot search: {'; '.join(lost)}. A re-lock here would "
                         "replace it with a build without them: run where they can run, write to another --out, "
                         "or pass --force")
