"""The red team's cheats (tests/workbench/agent/test_judge_red_team.py) through a checkout's judge, as a
user runs it (static check on) and, where the judge can, without the static check; plus the wall time
of judging an honest faster candidate (the judge's overhead per attempt). Writes OUT/LABEL.json.

The judge is whatever `workbench` the interpreter imports: put an older checkout first on PYTHONPATH
to judge with it (the cheats always come from this checkout's tests).

    PYTHONPATH=. python scripts/judge_red_team.py runs/judge-red-team-cpu now
    PYTHONPATH=/tmp/old python scripts/judge_red_team.py runs/judge-red-team-cpu before   # git worktree
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "workbench" / "agent"))

import test_judge_red_team as red  # noqa: E402

from workbench.agent import judge as judge_module  # noqa: E402
from workbench.agent.judge import Task, judge  # noqa: E402
from workbench.points import Workload  # noqa: E402


def verdict(source: str, incumbent: str, static_check: bool) -> dict:
    work = Path(tempfile.mkdtemp())
    path = work / "boundary__cheat.py"
    path.write_text(source)
    task = Task("boundary", "cheat", {"sliding": Workload(dtype="fp32")}, {"sliding": 1}, incumbent="slow",
                incumbent_file=incumbent, timeout_s=120, timing=red.TIMING, seeds=1)
    kw = {} if static_check else {"static_check": False}
    started = time.perf_counter()
    try:
        v = judge(str(path), task, work_dir=str(work / "work"), **kw)
    except Exception as e:  # noqa: BLE001 - a judge that crashes on a cheat is a finding
        return {"accepted": None, "stage": "judge raised", "reason": f"{type(e).__name__}: {e}"}
    return {"accepted": v.accepted, "stage": v.stage, "reason": v.reason[:300],
            "seconds": round(time.perf_counter() - started, 2)}


def main() -> int:
    out, label = Path(sys.argv[1]), sys.argv[2]
    incumbent = Path(tempfile.mkdtemp()) / "boundary__slow.py"
    incumbent.write_text(red.SLOW)
    can_skip = "static_check" in inspect.signature(judge).parameters
    results = {}
    for name in sorted(red.CHEATS):
        source = red.candidate(*red.CHEATS[name])
        results[name] = {"static_check": verdict(source, str(incumbent), True)}
        if can_skip:
            results[name]["no_static_check"] = verdict(source, str(incumbent), False)
        print(name, results[name], flush=True)
    honest = [verdict(red.candidate("    return _once(y, h, w, eps)\n"), str(incumbent), True) for _ in range(3)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=os.path.dirname(judge_module.__file__),
                            capture_output=True, text=True).stdout.strip()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{label}.json").write_text(json.dumps({
        "judge_commit": commit, "command": " ".join(sys.argv), "cheats": results,
        "honest_faster": honest, "honest_seconds_per_attempt": sorted(h.get("seconds", 0) for h in honest)[1],
        "cpus": os.cpu_count()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
