"""Candidates that never finish: a hang or a crash costs one run of the search, not the search.

Before a candidate runs, it is recorded in its point's in-flight file (`search/<point>.inflight`), and
cleared once it returns; a watchdog ends the process (exit status EXIT_STALLED) when one candidate
runs past its time limit, not counting compilers it starts (`workbench.watchdog`), since a thread stuck
in a kernel or a compiler cannot be interrupted. A resumed search reads the record: each variant with
a candidate left there is skipped with the reason (its other tuning configs run the same code), except
one the run was stopped in from outside (Ctrl-C, a time limit), which is tried again, up to STOPS_TRIED
runs. A variant that hung in a point's last search is not tried again while its code is unchanged.

What it must never do: gate, time or choose a candidate (the search does), or skip a variant whose
code changed since it hung.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from typing import Callable, TypeVar

from workbench.lock import code_key_matches
from workbench.run_folder import read_json, write_json
from workbench.watchdog import Watchdog

STALLED = "did not finish in an earlier run of this search"  # a skip reason's mark: the candidate hung
EXIT_STALLED = 5  # the process exit status when the watchdog ends a stalled candidate
# A candidate in flight when the run was stopped from outside did not hang (a JIT build cut off by a
# command's time limit): the next run tries it again. One stopped in this many runs is skipped like a
# hung one (a build longer than any command).
STOPS_TRIED = 2

T = TypeVar("T")


class InFlight:
    """One point's in-flight record, for the search of that point at `fingerprint` (what its cached
    result is keyed by): `unfinished` holds the candidates earlier processes never finished."""

    def __init__(self, path: str, fingerprint: dict):
        self.path, self.fingerprint = path, fingerprint
        saved = read_json(path)
        self.unfinished: list[dict] = saved["candidates"] if isinstance(saved, dict) and \
            saved.get("fingerprint") == fingerprint else []

    def _write(self, candidates: list[dict]) -> None:
        write_json(self.path, {"fingerprint": self.fingerprint, "candidates": candidates}, indent=1)

    def stuck(self, name: str) -> dict | None:
        """The record of an earlier run's unfinished candidate that makes variant `name` skipped, or None:
        records left by runs stopped from outside fewer than STOPS_TRIED times skip nothing."""
        def retried(c):
            return 0 < c.get("stopped", 0) < STOPS_TRIED
        return next((c for c in self.unfinished if c["variant"] == name and not retried(c)), None)

    def watched(self, candidate: dict, run: Callable[[], T], *, timeout_s: float | None,
                on_stall: Callable[[dict], None]) -> tuple[T, float]:
        """`run()`, with `candidate` recorded as in flight meanwhile (beside the unfinished ones) and a
        watchdog on its time; returns its result and the seconds compilers it started ran."""
        self._write(self.unfinished + [candidate])
        dog = Watchdog(timeout_s, on_stall, candidate).start() if timeout_s else None
        try:
            result = run()
        except KeyboardInterrupt:  # stopped from outside: recorded as such, and tried again (STOPS_TRIED)
            stops = max((c.get("stopped", 0) for c in self.unfinished if c["variant"] == candidate["variant"]),
                        default=0)
            self._write([c for c in self.unfinished if c["variant"] != candidate["variant"]]
                        + [{**candidate, "stopped": stops + 1}])
            raise
        finally:
            compile_s = dog.stop() if dog is not None else 0.0
        self._write(self.unfinished)  # only once it returned: a dying process leaves it
        return result, compile_s

    def clear(self) -> None:
        if os.path.exists(self.path):
            os.remove(self.path)


def stalled_before(saved: dict | None, fingerprint: dict, point: str, result_path: str) -> dict[str, str]:
    """The variants that never finished in the point's last search (`saved`: its search result file)
    at the same shapes and whose code has not changed since (its source hash, or its `code_key`: config
    lists aside), with the reason to skip each: the point is searched again because another variant
    changed, and trying them again would cost the same hang."""
    try:
        old, candidates = saved["fingerprint"], saved["result"]["candidates"]
    except (KeyError, TypeError):
        return {}
    if any(old.get(k) != fingerprint[k] for k in ("target", "preset", "dtype", "device", "calls", "workloads")):
        return {}
    keys = saved.get("code_keys", {})

    def unchanged(name: str) -> bool:
        return old.get("sources", {}).get(name) == fingerprint["sources"].get(name) or (
            name in keys and name in fingerprint["sources"] and code_key_matches(keys[name], point, name))

    return {c["variant"]: f"{c['skipped'].split(';')[0]}; its code is unchanged since, so it is not tried "
                          f"again (delete {result_path} to try)"
            for c in candidates if STALLED in (c.get("skipped") or "") and unchanged(c["variant"])}


def end_process(candidate: dict) -> None:
    """The watchdog's default: say which candidate stalled and where, then end the process."""
    builds = f", not counting {candidate['compile_s']:.0f} s of compilers it ran" if candidate.get("compile_s") else ""
    print(f"\nworkbench: {candidate['point']}:{candidate['variant']} {candidate['config'] or ''} ran past "
          f"{candidate['timeout_s']:.0f} s (gate + timing{builds}); ending the process. The same command resumes the "
          f"search and skips this variant (recorded in search/{candidate['point']}.inflight).",
          file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)  # where it was stuck (the main thread's frames)
    os._exit(EXIT_STALLED)  # the stuck thread (a kernel, a compiler) cannot be interrupted from here
