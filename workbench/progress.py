"""Live console output for long runs (optimize): one line per stage, candidate and point, then a summary.

Presentation only: it prints the events (`workbench.events`) that `workbench.optimize`, the search,
the end-to-end stage and the agent loop emit, and the report's lines; it never decides anything.
"""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from workbench import events
from workbench.profiler.idle import idle_line
from workbench.registry import COMPOUNDS
from workbench.report import (
    challenge_lines,
    compile_baselines,
    noise_line,
    paired_words,
    plain_lines,
    ranks_line,
    regated_words,
)


class ConsoleProgress:
    def __init__(self, console: Console | None = None):
        self.console = console or Console()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def event(self, e: events.Event) -> None:
        c = self.console
        match e:
            case events.StageStarted():
                extra = f" ({', '.join(e.order)})" if e.order is not None else ""
                c.print(f"[bold]== {e.stage}[/]{extra}")
            case events.Profiled():
                c.print(profile_table(e.profile))
            case events.PointStarted():
                c.print(f"[bold]{e.point}[/]: gating and timing candidates")
            case events.Regated():
                c.print(f"[bold]{e.point}[/]: {regated_words(e.variant, e.passed, e.was_failed)}")
            case events.PointCached():
                c.print(f"[bold]{e.point}[/]: resumed from the run folder -> {e.result.choice}")
            case events.CandidateTried(result=r):
                built = f", {r.compile_s:.1f} s of it compiling" if r.compile_s else ""
                took = f" ({r.seconds:.1f} s{built})" if r.seconds is not None else ""
                if r.skipped:
                    c.print(f"  {r.variant:<16} skipped: {r.skipped}")
                elif not r.gate_passed:
                    c.print(f"  {r.variant:<16} [red]gate failed[/]: {r.failed_check}{took}")
                else:
                    cfg = f" {r.config}" if r.config else ""
                    c.print(f"  {r.variant:<16} {r.step_us:10.1f} us/step  x{r.speedup:.2f}  "
                            f"spread {100 * r.spread:.1f}%{cfg}{took}")
            case events.CandidateRetimed(result=r):
                c.print(f"  {r.variant:<16} timed again ({100 * r.noisy_timing['spread']:.1f}% spread at "
                        f"{r.noisy_timing['step_us']:.1f}): {r.step_us:10.1f} us/step  spread "
                        f"{100 * r.spread:.1f}%{' ' + str(r.config) if r.config else ''}")
            case events.PointDone(result=r):
                # a compound's incumbent: its members' choices run apart (the first row)
                apart = f", members apart {r.candidates[0].step_us:.1f}" if r.point in COMPOUNDS else ""
                c.print(f"  -> [green]{r.choice}[/] ({r.reference_us:.1f} -> {r.choice_us:.1f} us/step{apart}, "
                        f"noise band {100 * r.band:.1f}%)")
            case events.InStepLine():
                c.print(f"  {e.line}", highlight=False)
            case events.AgentRound():
                c.print(f"[bold]{e.point}[/]: agent round {e.round} in {e.task}")
            case events.AgentAttempt():
                verdict = "[green]accepted[/]" if e.accepted else f"[red]rejected[/] ({e.stage})"
                c.print(f"  {e.variant:<16} {verdict}: {e.reason}")
            case events.ModelGateDropped():
                c.print(f"  [red]{e.point}:{e.variant} dropped[/]: fails the model gate ({e.why})")
            case events.EndToEndResumed():
                which = f"{e.builds} of the " if e.builds is not None else ""
                c.print(f"  {which}builds timed and gated by an earlier run of this folder (end_to_end.json): reused")
            case events.Reverted():
                c.print(f"  {e.point}: step {e.locked_us:.1f} us, {e.reverted_us:.1f} us with it reverted")
            case events.Challenged():
                verdict = (f"fails the model gate ({e.model_gate})" if e.gain is None else
                           f"with the choice the step is {paired_words(e.as_dict())}")
                c.print(f"  {e.point}: {e.variant} {e.config or ''} tied at the op level, tried end to end: "
                        f"{verdict}: {'taken' if e.won else 'not taken'}")
            case events.PairedTimed():
                verdict = "kept" if e.kept else "to be dropped"
                c.print(f"  each reverted within the noise: {', '.join(f'{p}:{v}' for p, v in e.choices.items())}; "
                        f"without them the step is {paired_words(e.as_dict())}: {verdict}")
            case events.DroppedAsNoise():
                c.print(f"  dropped as noise (each reverted within {100 * e.band:.1f}%): "
                        f"{', '.join(f'{p}:{v}' for p, v in e.choices.items())}; step {e.before_us:.1f} us "
                        f"with them, {e.after_us:.1f} us without")

    def stopped(self, r: dict) -> None:
        self.console.print(f"[yellow]budget spent[/]: searched {', '.join(r['searched']) or 'nothing'}; "
                           f"pending {', '.join(r['pending'])}. Run the same command again to resume "
                           f"from {r['out_dir']}.")

    def summary(self, r: dict, out_dir: str) -> None:
        t = Table(title=f"{r['target']} on {r['preset']} ({r['dtype']}, {r['gpu'] or 'cpu'})")
        for col in ("build", "step ms", "locked speed-up"):
            t.add_column(col, justify="right" if col != "build" else "left")
        t.add_row("reference", f"{r['reference_ms']:.3f}", f"{r['speedup']:.2f}x")
        baselines = compile_baselines(r)
        for b in baselines:
            name = "torch.compile" if b["mode"] == "points" else f"torch.compile ({b['mode']})"
            t.add_row(name, *((f"{b['ms']:.3f}", f"{b['speedup']:.2f}x") if b["ms"] else ("failed", "")))
        t.add_row("locked", f"{r['locked_ms']:.3f}", "")
        self.console.print(t)
        if r.get("timed_apart"):
            self.console.print(f"[yellow]timed in a process other than the locked build's[/] (ratios to it pair "
                               f"two processes): {', '.join(r['timed_apart'])}")
        for b in baselines:
            for point, why in (b.get("left_out") or {}).items():
                self.console.print(f"torch.compile build: {point} kept at its reference: {why}")
            if b.get("error"):
                self.console.print(b["error"])
        for line in plain_lines(r):
            self.console.print(line)
        for line in (ranks_line(r), noise_line(r)):
            if line:
                self.console.print(line)
        for line in challenge_lines(r):
            self.console.print(line)
        locked = {p["point"]: p["variant"] for p in r["points"] if p["variant"] != "torch"}
        self.console.print(f"locked variants: {locked or 'reference everywhere'}")
        self.console.print(f"wrote {out_dir}/lock.yaml, report.md, report.json, profile.json")


def profile_table(profile) -> Table:
    unit = "device" if profile.time_unit == "device" else "CPU"
    t = Table(title=f"{profile.target} on {profile.preset} ({profile.dtype}, {profile.device}): "
                    f"{profile.total_us / 1e3:.3f} ms of {unit} time, {profile.kernels_per_step} kernels",
              caption=idle_line(profile.idle), box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,
              show_edge=False)
    rows = [(p.point, p.variant, str(p.calls), f"{p.time_us:.1f}", f"{100 * p.share:.1f}%", str(p.kernels),
             f"{p.floor_us:.1f}" if p.floor_us else "-", f"{p.headroom:.1f}" if p.headroom else "-")
            for p in profile.points]
    # names never shrink to an ellipsis ("attentio…", "triton…"): at 80 columns the number headers wrap instead
    for i, col in enumerate(("point", "variant", "calls", "us/step", "share", "kernels", "floor us", "x floor")):
        name = i < 2
        t.add_column(col, justify="left" if name else "right", no_wrap=name,
                     min_width=max((len(r[i]) for r in rows), default=1) if name else None)
    for r in rows:
        t.add_row(*r)
    return t


def in_step_table(r: dict) -> Table:
    """`workbench profile --in-step`: each point's (or group's) cost in the step as it runs, beside its floor."""
    how = "graphed" if r["graphed"] else "eager"
    t = Table(title=f"{r['target']} on {r['preset']}: the step ({how}) {r['step_ms']:.3f} ms, and with each point "
                    f"stood in for by a kernel-free stand-in (best of {r['rounds']} rounds)",
              caption="cost: the step's time less the step's with it stood in for (the most a fusion of it saves)"
                      + ("" if r["graphed"] else "; eager: host time included, costs within the timings' spread "
                                                 "are noise"),
              box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True, show_edge=False)
    # a group's points and variants wrap between names (spaces); no name and no number is ever cut
    rows = [(" + ".join(label.split("+")), ", ".join(sorted(set(c["variants"].values()))), f"{c['step_ms']:.3f}",
             f"{c['cost_ms']:.3f}", f"{100 * c['cost_ms'] / r['step_ms']:.1f}%",
             f"{c['floor_ms']:.3f}" if c["floor_ms"] else "-",
             f"{c['cost_ms'] / c['floor_ms']:.1f}" if c["floor_ms"] >= 0.01 * r["step_ms"] else "-")
            for label, c in r["costs"].items()]
    for i, col in enumerate(("stood in for", "variant", "step ms", "cost ms", "share", "floor ms", "x floor")):
        widest = max((len(word.rstrip(",")) for row in rows for word in row[i].split()), default=1)
        t.add_column(col, justify="left" if i < 2 else "right", min_width=widest, no_wrap=i >= 2)
    for row in rows:
        t.add_row(*row)
    return t
