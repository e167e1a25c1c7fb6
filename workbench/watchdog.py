"""The search's watchdog on one candidate: it calls `on_stall` once the candidate has run past its
limit, not counting the time a compiler the process started was running.

Why compilers are not counted: a candidate's first call may build its kernels in child processes
(FlashInfer's JIT runs ninja and nvcc for minutes on a fresh host; Inductor runs C++ compilers and
ptxas). Counted, such a build would end a correct candidate as hung, and the resumed search would
skip it (docs/decisions.md, 18). A compiler that itself runs longer than `compile_limit_s` counts as
hung too.

Children are found through /proc (Linux); where it is missing, every second counts.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

# Process names (/proc/PID/comm, at most 15 characters) of the compilers and build tools a first call runs
COMPILERS = frozenset({"ninja", "nvcc", "cicc", "ptxas", "nvlink", "fatbinary", "cudafe++", "cc1plus", "cc1",
                       "gcc", "g++", "c++", "clang", "clang++", "ld", "collect2"})
COMPILE_LIMIT_S = 1800.0
TICK_S = 1.0


def running_compiler(root: int | None = None) -> str | None:
    """The name of a compiler process descended from process `root` (default: this one), or None."""
    root = os.getpid() if root is None else root
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    parent, name = {}, {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:  # it ended meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split at the last one
        head, _, rest = stat.rpartition(")")
        name[pid], parent[pid] = head.partition("(")[2], int(rest.split()[1])
    for pid, comm in name.items():
        if comm not in COMPILERS:
            continue
        up, steps = parent.get(pid), 0
        while up and up != root and steps < len(name):
            up, steps = parent.get(up), steps + 1
        if up == root:
            return comm
    return None


class Watchdog:
    """Runs `on_stall(candidate)` from a thread once the candidate has run `limit_s` seconds with no
    compiler of this process running, or a compiler has run `compile_limit_s`. `stop()` ends it and
    returns the seconds a compiler was seen running (the candidate's build time, reported apart)."""

    def __init__(self, limit_s: float, on_stall: Callable[[dict], None], candidate: dict, *,
                 compile_limit_s: float = COMPILE_LIMIT_S, tick_s: float | None = None):
        self.limit_s, self.on_stall, self.candidate = limit_s, on_stall, candidate
        self.compile_limit_s = compile_limit_s
        self.tick_s = tick_s if tick_s is not None else min(TICK_S, limit_s / 4)
        self.compile_s = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> float:
        """Ends the watch (waiting for a tick in progress, so the seconds are final) and returns them."""
        self._done.set()
        self._thread.join()
        return self.compile_s

    def _watch(self) -> None:
        idle, last = 0.0, time.monotonic()
        while not self._done.wait(self.tick_s):
            now = time.monotonic()
            if running_compiler():
                self.compile_s += now - last
            else:
                idle += now - last
            last = now
            # not once stopped: the candidate returned while this tick scanned /proc
            if (idle >= self.limit_s or self.compile_s >= self.compile_limit_s) and not self._done.is_set():
                self.on_stall({**self.candidate, "compile_s": round(self.compile_s, 1)})
                return
