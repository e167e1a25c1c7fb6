"""The optimize report: report.json's derived fields, report.md, and the words the console shares.

`report_markdown` renders report.json's content; `rerender` rewrites a finished run's report in the
current format from its own files (`workbench report DIR`); the other functions derive report fields
from the search's results and the end-to-end stage's result, or put a decision in words (the same
words in report.md, the console and the TUI).

What it must never do: time, gate or choose anything, or write a figure the run did not measure.
"""

from __future__ import annotations

import json
import math

from workbench.bench_report import config_text
from workbench.compile_baseline import PLAIN
from workbench.lock import run_by
from workbench.profiler.idle import idle_line
from workbench.registry import COMPOUNDS, REFERENCE
from workbench.run_folder import RunFolder, read_json
from workbench.search_results import PointResult


def backend_bests(result) -> dict[str, float]:
    """Each backend's fastest candidate that passed its gate at this point, in ms per step (the
    reference counts as torch): which backend won, and by how much over the others. Candidates
    launched with PDL count as "<backend>+pdl", so the report shows what PDL itself gained. A compound's
    reference row is timed as its members' choices run apart ("apart")."""
    best: dict[str, float] = {}
    for c in result.candidates:
        if c.step_us is not None and c.gate_passed:
            key = "apart" if result.point in COMPOUNDS and c.variant == REFERENCE else c.backend
            key += "+pdl" if (c.config or {}).get("pdl") else ""
            best[key] = min(best.get(key, math.inf), c.step_us / 1e3)
    return dict(sorted(best.items(), key=lambda kv: kv[1]))


def locked_point_us(r, variant: str, config: dict | None) -> float:
    """The search's timing of the point at the locked variant and config: the choice's, or another
    candidate's when the end-to-end stage swapped it in (a candidate tied at the op level) or dropped
    the choice."""
    cand = r.candidate(variant, config)
    if cand is not None and cand.step_us is not None:
        return cand.step_us
    return r.reference_us if variant == REFERENCE else r.choice_us


def timed_apart(final: dict, baselines: dict) -> list[str] | None:
    """The report's builds not timed in the locked build's process (a resumed run keeps the timings of
    earlier processes), whose ratios to it pair two processes; None when the locked build's process was
    not recorded. A build whose process was not recorded counts as apart."""
    locked = final["locked"].get("process")
    if locked is None:
        return None
    processes = {"reference": final["reference"].get("process"),
                 **{f"{p} reverted": q for p, q in (final.get("reverted_process") or {}).items()},
                 **({"the chosen set before the drop": final["before_drop"].get("process")}
                    if final.get("before_drop") else {}),
                 **{_compile_row(mode): b[3] if len(b) > 3 else None for mode, b in baselines.items()}}
    return [build for build, process in processes.items() if process != locked]


def mark_run_by_compounds(report: dict) -> None:
    """Each member of a compound point locked at a fused variant gets `run_by` ("attention_out:triton"):
    the locked build runs that variant's kernels in the member's place, so the member's own selection
    (left at its reference by the end-to-end stage: reverting it changed nothing) never runs."""
    members = run_by({p["point"]: p["variant"] for p in report["points"]})
    for p in report["points"]:
        p.pop("run_by", None)
        if p["point"] in members:
            p["run_by"] = members[p["point"]]


def _run_by_points(report: dict) -> dict[str, str]:
    """The `run_by` marks `mark_run_by_compounds` left on a report's points, by point."""
    return {p["point"]: p["run_by"] for p in report.get("points", []) if p.get("run_by")}


def against_previous(previous: dict | None, report: dict) -> dict | None:
    """What this lock changed against the one it replaces in the run folder (same target, preset,
    dtype and GPU): the locked step then, and each point whose variant or tuning config changed. A
    rerun that locks the same build keeps the comparison the previous report made."""
    if not previous or any(previous.get(k) != report[k] for k in ("target", "preset", "dtype", "gpu")):
        return None
    was = {p["point"]: p for p in previous.get("points", [])}

    def moved(p):  # a report from before points carried their config compares variants only
        old = was[p["point"]]
        return _choice(old) != (_choice(p) if "config" in old else p["variant"])
    changed = [{"point": p["point"], "was": _choice(was[p["point"]]), "was_ms": was[p["point"]].get("ms"),
                "now": _choice(p), "now_ms": p["ms"]}
               for p in report["points"] if p["point"] in was and moved(p)]
    if not changed and previous.get("locked_ms") == report["locked_ms"]:
        return previous.get("previous")  # the same lock written again (a resumed, finished run)
    return {"locked_ms": previous.get("locked_ms"), "git_commit": (previous.get("environment") or {}).get("git_commit"),
            "changed": changed}


def rerender(out_dir: str) -> dict:
    """Rewrite a finished run's report.json / report.md in the current format from its report.json and
    search/*.json (fields derived from the search results, and the step's floor from locked_profile.json,
    are recomputed); nothing is timed again."""
    folder = RunFolder(out_dir)
    with open(folder.path(folder.REPORT)) as f:
        report = json.load(f)
    locked_profile = folder.read(folder.LOCKED_PROFILE)
    if locked_profile:  # the step's floor and the points' floors beside it from one profile's ceilings
        floor_us = sum(pp.get("floor_us") or 0.0 for pp in locked_profile["points"])
        report["floor_ms"] = floor_us / 1e3
        report["fraction_of_floor"] = floor_us / (report["locked_ms"] * 1e3) if floor_us else None
    for p in report["points"]:
        saved = read_json(folder.search_result(p["point"]))
        # a point the run did not search has none
        p["best_ms_by_backend"] = backend_bests(PointResult.from_dict(saved["result"])) if saved else {}
    mark_run_by_compounds(report)
    write_report(folder, report)
    return report


def write_report(folder: RunFolder, report: dict) -> None:
    """report.json and report.md, each written whole."""
    folder.write(folder.REPORT, report)
    with open(folder.path(folder.REPORT_MD), "w") as f:
        f.write(report_markdown(report))


# ---- words -------------------------------------------------------------------------------------------

def slower_by(gain: float) -> str:
    """A paired timing's gain in words: "0.42% slower", or "0.43% faster" when it is negative."""
    return f"{100 * abs(gain):.2f}% {'slower' if gain >= 0 else 'faster'}"


def paired_words(paired: dict) -> str:
    """A paired timing in words: "0.42% slower in 10 paired rounds (band 0.50%)"."""
    return f"{slower_by(paired['gain'])} in {len(paired['rounds'])} paired rounds (band {100 * paired['band']:.2f}%)"


def regated_words(variant: str, passed: bool, was_failed: bool) -> str:
    """A cached choice (or gate failure, `was_failed`) gated again under the current gates, in words,
    with what follows."""
    if was_failed:
        return (f"cached gate failure {variant} gated again under the current gates: "
                f"{'passes: searching the point again' if passed else 'fails again'}")
    return (f"cached choice {variant} gated again under the current gates: "
            f"{'passes' if passed else 'fails: searching the point again'}")


# ---- report.md ---------------------------------------------------------------------------------------

def _fmt(x) -> str:
    return f"{x:.3f}" if isinstance(x, (int, float)) else "-"


def _against_previous_lines(previous: dict, locked_ms: float, run_by: dict[str, str] | None = None) -> list[str]:
    lines = ["", "## Against the lock this one replaced", "",
             f"Locked step: {_fmt(previous['locked_ms'])} ms then (commit {previous.get('git_commit')}), "
             f"{locked_ms:.3f} ms now."]
    if not previous["changed"]:  # same choices: the difference is the variants' code, or the device and the run
        lines[-1] += " No point's locked variant or config changed."
        return lines
    return lines + ["Points whose locked variant or config changed:", "",
                    "| point | was | ms/step | now | ms/step |", "| --- | --- | ---: | --- | ---: |",
                    *[f"| {c['point']} | {c['was']} | {_fmt(c['was_ms'])} | " +
                      (f"run by {run_by[c['point']]} | - |" if c["point"] in (run_by or {}) else
                       f"{c['now']} | {_fmt(c['now_ms'])} |")
                      for c in previous["changed"]]]


def _choice(point: dict) -> str:
    config = point.get("config")
    return point["variant"] + (f" {config_text(config)}" if config else "")


def compile_baselines(r: dict) -> list[dict]:
    """A report's torch.compile rows; reports written before there could be several hold one."""
    if "torch_compile_baselines" in r:
        return r["torch_compile_baselines"]
    return [{"mode": r.get("torch_compile_baseline", "points"), "ms": r["torch_compile_ms"],
             "speedup": r["speedup_vs_torch_compile"], "left_out": r.get("torch_compile_left_out") or {},
             **({"error": r["torch_compile_error"]} if r.get("torch_compile_error") else {})}]


def ranks_line(r: dict) -> str | None:
    """The reference and locked steps timed on the --tp ranks at once (None: one process only)."""
    across = r.get("across_ranks")
    if not across:
        return None
    ref, locked = (across["builds"][b] for b in ("reference", "locked"))
    return (f"On {across['world']} ranks at once ({across['backend']}, each step the slowest rank's median of "
            f"{across['reps']}): reference {ref['step_ms']:.3f} ms, locked {locked['step_ms']:.3f} ms, "
            f"{across['speedup']:.2f}x.")


def noise_line(r: dict) -> str | None:
    """What the end-to-end rule did with the choices each reverted within the step's noise band: dropped
    together, or kept because a paired timing found the set faster with them (None: there were none)."""
    paired = r.get("paired")
    if not r.get("dropped") and not paired:
        return None
    run_by = _run_by_points(r)  # a member of a compound locked at a fused variant: its choice never ran
    choices = ", ".join(f"{p}:{v}" + (f" ({run_by[p]} runs in its place)" if p in run_by and r.get("dropped") else "")
                        for p, v in (r.get("dropped") or paired["choices"]).items())
    band = f" ({100 * r['step_band']:.1f}%)" if r.get("step_band") is not None else ""
    pairs = (f"; in a paired timing ({len(paired['rounds'])} alternating rounds) the set without them was "
             f"{slower_by(paired['gain'])}, band {100 * paired['band']:.2f}%" if paired else "")
    if not r.get("dropped"):
        return f"Kept at the end-to-end stage, each reverted within the step's noise band{band}: {choices}{pairs}."
    before = (f"; the chosen set with them timed {r['before_drop_ms']:.3f} ms, the locked set without them "
              f"{r['locked_ms']:.3f} ms" if r.get("before_drop_ms") else "")
    return (f"Dropped at the end-to-end stage, each reverted within the step's noise band{band}: "
            f"{choices}{pairs}{before}.")


def challenge_lines(r: dict) -> list[str]:
    """One line per candidate tried end to end against a point's choice (tied with it at the op level)."""
    lines = []
    for point, c in (r.get("challenges") or {}).items():
        what = f"{point}:{c['variant']}" + (f" {json.dumps(c['config'], sort_keys=True)}" if c.get("config") else "")
        head = (f"Tried end to end, tied with the choice at the op level: {what} ({c['op_us']:.1f} us/step "
                f"against the choice's {c['choice_op_us']:.1f})")
        if "gain" not in c:
            lines.append(f"{head}: fails the model gate in the set ({c.get('model_gate')}), not taken.")
        else:
            lines.append(f"{head}: with the choice the step was {paired_words(c)}: "
                         f"{'taken' if c['won'] else 'not taken'}.")
    return lines


def _compile_row(baseline: str) -> str:
    if baseline == "points":
        return "torch.compile (every point)"
    if baseline.startswith(PLAIN):
        mode = baseline.removeprefix(PLAIN)
        return f"torch.compile of the whole step from the fastest plain-PyTorch variants ({mode})"
    return f"torch.compile of the whole reference step ({baseline})"


def plain_lines(r: dict) -> list[str]:
    """What each plain-PyTorch compile baseline ran in place of the reference."""
    return [f"The plain-PyTorch torch.compile build ({b['mode']}) runs "
            + (", ".join(f"{p}:{v}" for p, v in b["variants"].items()) or "no variant faster than a reference")
            + "; every other point its reference."
            for b in compile_baselines(r) if "variants" in b]


def code_line(env: dict) -> str:
    """Which code ran: the commit, and when the files differed from it (uncommitted edits, or a copy of
    the tree whose .git is older than its files, as on the GPU host) the tree they hash to, the name
    that then identifies them."""
    line = f"commit {env.get('git_commit')}"
    if env.get("git_dirty"):
        line += ", files changed since"
    return line + (f" (files: git tree {env['git_tree']})" if env.get("git_tree") else "")


def report_markdown(r: dict) -> str:
    idle = idle_line(r.get("locked_idle"))
    cost = bool(r.get("in_step"))  # each point's cost in the running step, timed (`--in-step`)
    lines = [
        f"# optimize {r['target']} on {r['preset']} ({r['dtype']})", "",
        f"Command: `{r['command']}`", "",
        f"Device: {r['gpu'] or 'cpu'}; torch {r['environment'].get('torch')}, "
        f"triton {r['environment'].get('triton')}; {code_line(r['environment'])}", "",
        "| build | step ms | speed-up of locked |", "| --- | ---: | ---: |",
        f"| reference | {r['reference_ms']:.3f} | {r['speedup']:.2f}x |",
        *[f"| {_compile_row(b['mode'])} | " + (f"{b['ms']:.3f} | {b['speedup']:.2f}x |" if b["ms"] else "failed | |")
          for b in compile_baselines(r)],
        f"| locked | {r['locked_ms']:.3f} | |", "",
        *([line, ""] if (line := ranks_line(r)) else []),
        *(["Timed in a process other than the locked build's (a resumed run; their ratios to it pair two "
           "processes): " + ", ".join(r["timed_apart"]), ""] if r.get("timed_apart") else []),
        *([line, ""] if (line := noise_line(r)) else []),
        *[line for c in challenge_lines(r) for line in (c, "")],
        *[line for b in compile_baselines(r) for line in ([b["error"], ""] if b.get("error") else [])],
        *[line for plain in plain_lines(r) for line in (plain, "")],
        *[line for b in compile_baselines(r) for p, why in (b.get("left_out") or {}).items()
          for line in (f"The torch.compile build keeps the reference at {p}: {why}", "")],
        f"Roofline floor of the step: {r['floor_ms']:.3f} ms"
        + (f" (locked step at {100 * r['fraction_of_floor']:.0f}% of floor speed)" if r["fraction_of_floor"] else ""),
        "", f"Kernels per layer: reference {r['kernels_per_layer']['reference']}, "
            f"locked {r['kernels_per_layer']['locked']}", "",
        *([f"In the locked step's profile (eager, under the profiler): {idle} (`locked_profile.json`, `idle`)", ""]
          if idle else []),
        "ms/step: the search's timing of the point at the step's shapes; in the locked step: the profiler's "
        "device time of the point in one locked step (`locked_profile.json`), beside its floor"
        + ("; cost in the running step: the locked step's time less its time with the point replaced by a stand-in "
           "that launches no kernel (`in_step.json`, best of "
           f"{r['in_step']['rounds']} rounds, the step {r['in_step']['step_ms']:.3f} ms there): what the point costs "
           "as the step runs, overlap included, and the most a fusion of it could save." if cost else "."), "",
        "| point | locked variant | backend | ms/step | reference ms/step | in the locked step, ms | "
        + ("cost in the running step, ms | " if cost else "") + "floor ms "
        "| step ms with it reverted | fastest gated candidate of each backend, ms/step |",
        "| --- | --- | --- | ---: | ---: | ---: | " + ("---: | " if cost else "") + "---: | ---: | --- |",
    ]
    for p in r["points"]:
        bests = ", ".join(f"{b} {ms:.3f}" for b, ms in (p.get("best_ms_by_backend") or {}).items()) or "-"
        in_step = f"{_fmt(p.get('in_step_ms'))} | " if cost else ""
        if p.get("run_by"):  # its own selection never runs in the locked build: no timing of it
            lines.append(f"| {p['point']} | run by {p['run_by']} | - | - | {_fmt(p['reference_ms'])} | - | "
                         f"{'- | ' if cost else ''}- | - | {bests} |")
            continue
        lines.append(f"| {p['point']} | {p['variant']} | {p['backend']} | {_fmt(p['ms'])} | "
                     f"{_fmt(p['reference_ms'])} | {_fmt(p.get('locked_step_ms'))} | {in_step}"
                     f"{_fmt(p.get('floor_ms'))} | {_fmt(p['reverted_ms'])} | {bests} |")
    if r.get("previous"):
        lines += _against_previous_lines(r["previous"], r["locked_ms"], _run_by_points(r))
    return "\n".join(lines) + "\n"
