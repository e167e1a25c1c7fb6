"""Where the device sat idle in a profiled step, and what the host was doing when it began.

An eager step's kernels can add up to less than its wall time: between two kernels the device waits
for the host to launch the next. The host normally runs ahead of the device, so a gap means it fell
behind: it waited on the device (`.item()` or another copy to the host, a copy from pageable memory,
a stream or event sync) or took longer to issue launches than the device took to drain its queue.
Each gap is named by the kernels on either side, the fusion point whose launch ended it, and the
host's innermost op, runtime call and point when it began. The profiler adds host time to every op,
so gaps can be wider than in a timed step; where they fall and what opens them is what this shows.
Reads a torch.profiler Chrome trace only.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

from workbench.profiler.ranges import POINT_RANGE
from workbench.profiler.trace import DEVICE_CATS, LAUNCH_CATS

NAME_CHARS = 100  # kernel names of templated libraries run to thousands of characters
OUTSIDE = "(no point)"  # a launch outside every fusion point's range (embedding, step set-up)


class _Timeline:
    """One host thread's intervals of one kind (ops, runtime calls, point ranges)."""

    def __init__(self, spans: list[tuple[float, float, str]]):
        self.spans = sorted(spans)
        self.starts = [lo for lo, _, _ in self.spans]

    def at(self, t: float) -> str | None:
        """The interval holding `t` that began last: the innermost, as a thread's intervals nest."""
        i = bisect.bisect_right(self.starts, t)
        while i > 0:
            i -= 1
            _, hi, name = self.spans[i]
            if hi >= t:
                return name
        return None


def _timelines(events: list[dict], keep) -> dict:
    by_tid = defaultdict(list)
    for e in events:
        if keep(e) and "dur" in e:
            by_tid[e.get("tid")].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    return {tid: _Timeline(spans) for tid, spans in by_tid.items()}


def _point(name: str | None) -> str | None:
    return name[len(POINT_RANGE):] if name else None


def device_idle(events: list[dict], top: int = 10) -> dict | None:
    """The step's device span (first kernel start to last kernel end), the time some kernel, copy or
    memset ran in it (streams overlapped once), the rest as idle; idle by the point whose launch
    ended each gap, and the `top` widest gaps. None when the trace holds no device work."""
    work = sorted((e["ts"], e["ts"] + e.get("dur", 0.0), e["name"], e.get("args", {}).get("correlation"))
                  for e in events if e.get("cat") in DEVICE_CATS and "ts" in e)
    if not work:
        return None
    launch = {e["args"]["correlation"]: (e["ts"], e.get("tid")) for e in events
              if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    points = _timelines(events, lambda e: e.get("cat") == "user_annotation" and e["name"].startswith(POINT_RANGE))

    gaps, busy, end, before = [], 0.0, work[0][0], None
    for lo, hi, name, corr in work:
        if lo > end:
            ts, tid = launch.get(corr, (None, None))
            by = points[tid].at(ts) if ts is not None and tid in points else None
            gaps.append({"start": end, "us": lo - end, "before": before, "after": name, "tid": tid,
                         "launched_in": _point(by) or OUTSIDE})
        if hi > end:
            busy += hi - max(lo, end)
            end, before = hi, name
    span = end - work[0][0]
    by_point = defaultdict(float)
    for g in gaps:
        by_point[g["launched_in"]] += g["us"]

    ops = _timelines(events, lambda e: e.get("cat") == "cpu_op")
    calls = _timelines(events, lambda e: e.get("cat") in LAUNCH_CATS)
    widest = []
    for g in sorted(gaps, key=lambda g: -g["us"])[:top]:
        tid = g.pop("tid")
        t = g.pop("start")
        widest.append({"at_us": t - work[0][0], **g,
                       "before": (g["before"] or "")[:NAME_CHARS], "after": g["after"][:NAME_CHARS],
                       "host_op": ops[tid].at(t) if tid in ops else None,
                       "host_call": calls[tid].at(t) if tid in calls else None,
                       "host_point": _point(points[tid].at(t)) if tid in points else None})
    return {"span_us": span, "busy_us": busy, "idle_us": span - busy, "gaps": len(gaps),
            "idle_by_point": dict(sorted(by_point.items(), key=lambda kv: -kv[1])), "widest": widest}


def idle_line(idle: dict | None, points: int = 3) -> str | None:
    """One sentence for a table caption or a report."""
    if not idle or not idle["span_us"]:
        return None
    ahead = ", ".join(f"{p} {us / 1e3:.3f}" for p, us in list(idle["idle_by_point"].items())[:points])
    return (f"device idle {idle['idle_us'] / 1e3:.3f} ms of its {idle['span_us'] / 1e3:.3f} ms span "
            f"({100 * idle['idle_us'] / idle['span_us']:.1f}%, {idle['gaps']} gaps)"
            + (f"; ms of it ahead of launches in: {ahead}" if ahead else ""))
