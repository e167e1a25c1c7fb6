"""Candidate code runs only while its own sandbox is timed: `Pause` keeps every process it may have started
stopped (SIGSTOP) the rest of the time, so nothing of the candidate's runs while the incumbent or the
empty call is timed, while the judge refills the inputs, or while it re-checks outputs.

Which processes: every descendant of this process (the worker, a subreaper, so what candidate code
started and orphaned, even with setsid, re-parents here) outside the trusted sandboxes' trees. A stop
holds once two scans in a row find every task of every such process stopped and send nothing: a
stopped process starts nothing and signals nothing, and one continued by another between two scans
is seen running in the second. Before a trusted sandbox is timed, its tree is continued, since the
candidate may have stopped it while it ran. Linux (/proc); elsewhere `Pause` does nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from workbench.agent.worker import PR_SET_CHILD_SUBREAPER, _descendants, _kill, _prctl

STOP_TIMEOUT_S = 10.0   # how long a stop may take before the judge gives up on the attempt


class PauseError(RuntimeError):
    """The candidate's processes could not be held stopped."""


def adopt_orphans() -> None:
    """Make this process the subreaper of what it starts: an orphan re-parents here, where `Pause` sees it."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


class Pause:
    """Stops and continues every process under this one outside the trees of `trusted` (pids)."""

    def __init__(self, trusted: list[int]):
        self.trusted = list(trusted)
        self.enabled = sys.platform.startswith("linux") and os.path.isdir("/proc/self/task")

    def _untrusted(self) -> list[int]:
        keep = set(self.trusted)
        for pid in self.trusted:
            keep.update(_descendants(pid))
        return [p for p in _descendants(os.getpid()) if p not in keep]

    def stop(self) -> None:
        """Every untrusted process stopped; PauseError after STOP_TIMEOUT_S."""
        if not self.enabled:
            return
        deadline, clean = time.monotonic() + STOP_TIMEOUT_S, 0
        while clean < 2:
            running = [p for p in self._untrusted() if not _stopped(p)]
            for pid in running:
                _kill(pid, signal.SIGSTOP)
            clean = 0 if running else clean + 1
            if running:
                if time.monotonic() > deadline:
                    raise PauseError(f"processes {running} the candidate started did not stop within "
                                    f"{STOP_TIMEOUT_S:.0f} s")
                time.sleep(0.0002)  # a stop signal is delivered when the process next runs

    def resume(self) -> None:
        """Every untrusted process continued."""
        if self.enabled:
            for pid in self._untrusted():
                _kill(pid, signal.SIGCONT)

    def release(self, pid: int) -> None:
        """`pid` and its tree continued (a trusted sandbox about to be timed)."""
        if self.enabled:
            for p in [pid, *_descendants(pid)]:
                _kill(p, signal.SIGCONT)

    def __enter__(self):
        self.stop()
        return self

    def __exit__(self, *exc):
        self.resume()


def _stopped(pid: int) -> bool:
    """Every task (thread) of `pid` stopped, or the process gone or a zombie."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("T", "t", "Z", "X"):
            return False
    return True
