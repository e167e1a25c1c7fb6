"""torch.profiler sessions without kineto's start/stop markers on the console.

torch 2.13's kineto writes `USDT:... profiler_start` and `... profiler_stop` to the process's
stderr (file descriptor 2, from C++) whenever a profile starts and stops, and no setting turns them
off: every `workbench profile` and `optimize` printed four such lines between its own. Only the
profiler's start and stop run with stderr held; any other line written then is passed on after.
"""

from __future__ import annotations

import os
import sys
import tempfile
from contextlib import contextmanager

from torch.profiler import profile

MARKER = "USDT:"


@contextmanager
def _without_markers():
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to hold (closed by a daemon): nothing would print anyway
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().decode(errors="replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not line.startswith(MARKER))
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()


@contextmanager
def profiling(activities):
    """`with torch.profiler.profile(activities=...) as prof`, its start and stop markers dropped."""
    prof = profile(activities=activities)
    with _without_markers():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _without_markers():
            prof.__exit__(*sys.exc_info())
