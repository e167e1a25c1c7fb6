"""`workbench optimize --agent CMD`: rounds of an external agent writing a variant, each judged.

For each of the points with the most headroom, round k writes a task folder
`<run>/agent/<point>/round-k/` (TASK.md: the point's contract, shapes, current best time and
floor, gate thresholds, the last attempt's verdict and timing; `variant.py`: the scaffold, to be
edited in place), runs `CMD <task folder>` with a time budget, takes back `variant.py` and judges
it (`workbench.agent.judge`: the same gates and timing as every candidate, in a worker process).
Every attempt is a line of `<run>/agent/attempts.jsonl`. An accepted variant is copied to
`<run>/agent/accepted/` and becomes the point's incumbent, registered here as a variant that runs in a
sandbox process (`candidates.load_sandboxed`): this process, which gates, times and locks, never imports
it. The end-to-end stage gates it here like any other variant and times the builds with it in a step
sandbox (`workbench.agent.step_sandbox`); the lock names its file.
"""

from __future__ import annotations

import datetime
import hashlib
import inspect
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import textwrap
import time
from dataclasses import dataclass, field

from workbench import registry
from workbench.agent import candidates, plugins, scaffold, worker
from workbench.agent.judge import SUSPECT, Task, judge
from workbench.events import AgentAttempt, AgentRound
from workbench.noise import MIN_BAND


@dataclass
class AgentOptions:
    command: str
    rounds: int = 3
    budget_s: float = 900.0          # wall-clock budget of one agent run
    points: int = 1                  # how many points, most headroom first
    worker_timeout_s: float = 600.0
    worker_mem_bytes: int = worker.DEFAULT_MEM_BYTES
    seeds: int = 2
    timing: dict = field(default_factory=dict)  # overrides of timing.time_call's arguments (tests)


@dataclass
class PointState:
    """Where a point stands: what the agent has to beat."""

    point: str
    workloads: dict                  # kind -> Workload
    calls: dict                      # kind -> calls per step
    incumbent: str
    incumbent_config: dict | None
    best_us: float                   # the incumbent's time per step
    reference_us: float
    floor_us: float | None
    incumbent_file: str | None = None  # a plugin incumbent's file (a --dir choice, an accepted variant)

    def gate_workloads(self) -> list:
        """Besides the target's shapes, a prefill chunk: the model gate runs prompts through it."""
        first = next(iter(self.workloads.values()))
        return [] if first.tokens_per_seq > 1 else \
            [w.with_(batch=2, tokens_per_seq=24, context=100) for w in self.workloads.values()]


def run_agent(command: str, task_dir: str, budget_s: float) -> dict:
    """Run `command task_dir` in its own process group; killed (the whole group) at the budget. Once
    it has ended, however it ended, whatever it started is ended too: its process group, and every
    process that carries its run mark in its environment (one that left the group with setsid). A
    SIGTERM or SIGINT meanwhile ends it the same way, then reaches this process's own handler."""
    argv = shlex.split(command) + [task_dir]
    mark = secrets.token_hex(8)
    started = time.monotonic()
    with open(os.path.join(task_dir, "agent.log"), "w") as log, worker.hold_signals() as held:
        try:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True,
                                    env={**os.environ, "WORKBENCH_TASK": task_dir, worker.RUN_ENV: mark})
        except OSError as e:
            return {"returncode": None, "seconds": 0.0, "timed_out": False, "error": f"cannot start {argv[0]}: {e}"}
        timed_out = False
        try:
            while not worker.exited(proc) and held.signum is None:
                if time.monotonic() - started > budget_s:
                    timed_out = True
                    break
                time.sleep(0.02)
        finally:
            worker.end_group(proc, mark)
    return {"returncode": proc.returncode, "seconds": round(time.monotonic() - started, 2), "timed_out": timed_out}


def agent_failure(agent: dict, budget_s: float, log_path: str) -> str | None:
    """Why the agent command's own run is the attempt's outcome (nothing of it is judged), or None
    when it ran to its end and exited 0."""
    if agent.get("error"):
        return agent["error"]
    if agent["timed_out"]:
        return f"the agent ran past its budget of {budget_s:.0f} s (killed)"
    code = agent["returncode"]
    if code is None or code == 0:
        return None
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the agent command died of {name}; its variant.py is not judged"
    last = ""
    try:
        with open(log_path, errors="replace") as f:
            last = next((ln.strip() for ln in reversed(f.read()[-4000:].splitlines()) if ln.strip()), "")
    except OSError:
        pass
    return f"the agent command exited with code {code}" + (f" ({last})" if last else "") + \
        "; its variant.py is not judged"


def _fmt(us) -> str:
    return "-" if us is None else f"{us:.3f}"


def task_markdown(state: PointState, name: str, k: int, rounds: int, opts: AgentOptions, shapes: str,
                  previous: dict | None, device: str) -> str:
    point = state.point
    ref = registry.reference(point)
    contract = inspect.getdoc(inspect.getmodule(ref.fn)) or ""
    from workbench.points import spec

    tol = spec(point).tolerance
    calls = ", ".join(f"{n} x {kind}" for kind, n in state.calls.items())
    headroom = state.best_us - (state.floor_us or 0.0)
    lines = [
        f"# Task: a faster `{point}` variant (round {k} of {rounds})", "",
        "Edit `variant.py` in this folder so that it computes exactly what the reference computes, faster.",
        "It starts as the reference inlined. It must register one variant, exactly as",
        f"`@register(\"{point}\", \"{name}\", BACKEND)` (BACKEND: torch, triton or cute). Leave it here:",
        f"when your command exits (budget: {opts.budget_s:.0f} s, then it is killed) the workbench takes",
        "`variant.py` back and judges it. See AGENTS.md at the repository root for the whole protocol.", "",
        "## Contract", "", textwrap.indent(contract, "    "), "",
        f"The reference's signature: `{ref.fn.__name__}{inspect.signature(ref.fn)}`.", "",
        f"## Shapes ({device}; calls per step: {calls})", "", textwrap.indent(shapes, "    "), "",
        "## Where it stands (microseconds per step, this machine)", "",
        "| | us per step |", "| --- | ---: |",
        f"| reference (`torch`) | {_fmt(state.reference_us)} |",
        f"| current best (`{state.incumbent}`) | {_fmt(state.best_us)} |",
        f"| roofline floor | {_fmt(state.floor_us)} |", "",
        f"Headroom: {_fmt(headroom)} us per step above the floor.", "",
        "## How it is judged", "",
        "1. Static check (no code runs): no call or import of the reference or the registry's lookups; no "
        "timing or profiling (`time`, CUDA events, `torch.profiler`); no threads, processes or extra CUDA "
        "streams; no file or network access; no `eval`/`exec`/`__import__`/`ctypes`/`gc`/`inspect`.",
        f"2. Op gate at the shapes above on fresh seeds ({opts.seeds} per shape), against the reference in "
        "FP64 on CPU / FP32 on GPU. Max relative error per output: "
        + ", ".join(f"{d} {t:g}" for d, t in tol.items())
        + ". Checks: runs, signature (count, shape, dtype, device of outputs), contiguous, finite (unwritten "
        "memory is NaN-poisoned), accuracy, inputs unchanged, deterministic, earlier outputs kept, right "
        "again on new values at the same addresses.",
        f"3. Timing in a separate process (limits: {opts.worker_timeout_s:.0f} s, "
        f"{opts.worker_mem_bytes / 2**30:.0f} GiB): the current best, your variant, the current best again, "
        "on rotated inputs each from its own seed; a random sample of the timed calls is re-checked "
        "against the reference. A crash, hang or illegal memory access is a rejection.",
        f"4. Accepted if faster than the current best beyond the noise band (at least {MIN_BAND:.0%}); a "
        f"time below {SUSPECT} x the roofline floor is flagged suspect and not locked without --trust.", "",
        "## Last attempt", "",
    ]
    if previous is None:
        lines.append("None yet.")
    else:
        lines.append(f"Round {previous['round']}: {'accepted' if previous['accepted'] else 'rejected'} "
                     f"at stage `{previous['stage']}`: {previous['reason']}")
        if previous.get("failed_check"):
            lines.append(f"First failing gate check: {previous['failed_check']}")
        t = previous.get("timing")
        if t:
            lines.append(f"Timing: {_fmt(t['candidate_us'])} us per step vs {_fmt(t['incumbent_us'])} us "
                         f"(x{t['speedup']:.2f}, noise band {t['band']:.1%}).")
        if previous.get("file"):
            lines.append(f"Its file: `{previous['file']}` (copied here as `previous.py`).")
    return "\n".join(lines) + "\n"


class AgentLoop:
    def __init__(self, opts: AgentOptions, *, out_dir: str, device: str = "cpu", trust: bool = False,
                 on_event=None):
        self.opts, self.device, self.trust = opts, str(device), trust
        self.root = os.path.join(out_dir, "agent")
        self.on_event = on_event or (lambda e: None)
        os.makedirs(self.root, exist_ok=True)

    def _name(self, point: str, k: int) -> str:
        name, n = f"agent_r{k}", 1
        while name in registry.variants(point):
            n += 1
            name = f"agent_r{k}_{n}"
        return name

    def _record(self, attempt: dict) -> None:
        with open(os.path.join(self.root, "attempts.jsonl"), "a") as f:
            f.write(json.dumps(attempt, default=str) + "\n")
        self.on_event(AgentAttempt(**{k: attempt[k] for k in ("point", "round", "variant", "accepted", "stage",
                                                              "reason")}))

    def run_point(self, state: PointState) -> list[dict]:
        """All rounds for one point; returns the attempts. Accepted variants are registered (sandboxed) and
        update `state` (incumbent, best_us), so the next round has to beat them."""
        attempts, previous = [], None
        shapes = scaffold.shapes_text(state.point, state.workloads)
        for k in range(1, self.opts.rounds + 1):
            attempt = self.round(state, k, shapes, previous)
            attempts.append(attempt)
            previous = attempt
        return attempts

    def round(self, state: PointState, k: int, shapes: str, previous: dict | None) -> dict:
        point = state.point
        name = self._name(point, k)
        task_dir = os.path.join(self.root, point, f"round-{k}")
        if os.path.isdir(task_dir):
            shutil.rmtree(task_dir)
        os.makedirs(task_dir)
        path = os.path.join(task_dir, "variant.py")
        given = scaffold.render(point, name, "torch", shapes).encode()
        with open(path, "wb") as f:
            f.write(given)
        if previous and previous.get("file") and os.path.isfile(previous["file"]):
            shutil.copy(previous["file"], os.path.join(task_dir, "previous.py"))
        with open(os.path.join(task_dir, "TASK.md"), "w") as f:
            f.write(task_markdown(state, name, k, self.opts.rounds, self.opts, shapes, previous, self.device))
        self.on_event(AgentRound(point, k, task_dir))
        agent = run_agent(self.opts.command, task_dir, self.opts.budget_s)
        attempt = {"point": point, "round": k, "variant": name, "file": path, "task": task_dir,
                   "source_hash": _hash(path), "agent": agent, "accepted": False, "suspect": False,
                   "gate_passed": None, "failed_check": None, "timing": None, "static": [],
                   "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        why = agent_failure(agent, self.opts.budget_s, os.path.join(task_dir, "agent.log"))
        if why is None and not os.path.isfile(path):
            why = "the agent left no variant.py in the task folder"
        if why is None and _read(path) == given:
            why = "the agent left variant.py as the scaffold it was given (unchanged): nothing of its own to judge"
        if why is not None:
            attempt.update(stage="agent", reason=why)
            self._record(attempt)
            return attempt
        task = Task(point, name, state.workloads, state.calls, state.incumbent, state.incumbent_config,
                    state.incumbent_file, state.gate_workloads(), self.device, state.floor_us, self.trust,
                    self.opts.seeds, self.opts.worker_timeout_s, self.opts.worker_mem_bytes, dict(self.opts.timing),
                    incumbent_record_us=state.best_us)
        verdict = judge(path, task, work_dir=task_dir)
        gate = verdict.gate or {}
        attempt.update(stage=verdict.stage, reason=verdict.reason, accepted=verdict.accepted,
                       suspect=verdict.suspect, gate_passed=gate.get("passed"), failed_check=verdict.failed_check,
                       timing=verdict.timing, static=verdict.static, recheck=verdict.recheck,
                       worker=verdict.worker, seed_base=verdict.seed_base)
        if verdict.accepted:
            attempt.update(self._accept(state, name, path, verdict))
        self._record(attempt)
        return attempt

    def _accept(self, state: PointState, name: str, path: str, verdict) -> dict:
        """Register the accepted file through a sandbox (never imported here); it becomes the incumbent."""
        dest = os.path.join(self.root, "accepted", scaffold.file_name(state.point, name))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copy(path, dest)
        candidates.load_sandboxed(dest, device=self.device)
        t = verdict.timing
        step_us = state.best_us * t["candidate_us"] / t["incumbent_us"]  # a ratio from one run, scaled
        state.incumbent, state.incumbent_config, state.best_us, state.incumbent_file = name, None, step_us, dest
        return {"accepted_file": dest, "step_us": step_us, "gate": verdict.gate}


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _hash(path: str) -> str | None:
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def agent_rounds(search, results: dict, profile, opts: AgentOptions, *, out_dir: str, trust: bool,
                 on_event=None) -> dict[str, list[dict]]:
    """The optimize hook: agent rounds for the points with the most headroom among `results`
    (`{point: search.PointResult}`); an accepted variant becomes that point's choice."""
    from workbench.search_results import CandidateResult

    loop = AgentLoop(opts, out_dir=out_dir, device=str(search.device.type), trust=trust, on_event=on_event)
    floors = {p.point: p.floor_us for p in profile.points}
    ranked = sorted(results, key=lambda p: results[p].choice_us - (floors.get(p) or 0.0), reverse=True)
    out = {}
    for point in ranked[:opts.points]:
        r = results[point]
        # A search choice from a plugin directory is loaded in the judge's worker like an accepted one.
        state = PointState(point, search.workloads(point), search.step_calls(point), r.choice, r.config, r.choice_us,
                           r.reference_us, floors.get(point), plugins.plugin_file(registry.get(point, r.choice)))
        out[point] = loop.run_point(state)
        for a in out[point]:
            if a["accepted"]:
                r.candidates.append(CandidateResult(point, a["variant"], registry.get(point, a["variant"]).backend,
                                                    None, True, step_us=a["step_us"],
                                                    spread=None, speedup=r.reference_us / a["step_us"],
                                                    gate=a["gate"] or {}))
        if state.incumbent != r.choice:
            r.choice, r.config, r.choice_us = state.incumbent, state.incumbent_config, state.best_us
    return out

