"""The judge of a candidate variant file: static check -> isolated gates and checked timing -> sanity.

`judge(path, task)` returns a `Verdict`: accepted, or the stage that rejected it and why.
1. Static check (`static_check`), and the file must register exactly the task's `point:name`.
2. In a worker process (`worker.run`, time and memory limits): the op gate at the task's
   workloads on seeds drawn fresh for this attempt (new values, and new addresses: a new process);
   then the incumbent, the candidate and the incumbent again, timed at the task's workloads with
   `checked_timing`: every rotated input copy is a fresh seed (never a clone), and a random sample
   of the timed calls runs with uninitialised memory poisoned and has its outputs re-checked
   against the reference afterwards (a variant right in the gate and wrong once timing starts fails).
3. A step time below SUSPECT x the roofline floor is flagged suspect: not accepted without `trust`.
4. Accepted only if faster than the incumbent beyond the noise band (the incumbent timed before and
   after the candidate; their gap, within [MIN_BAND, MAX_BAND]).
A crash, hang or CUDA error in the worker is a rejection with the reason; never an exception here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import secrets
from dataclasses import asdict, dataclass, field

from workbench.agent import worker
from workbench.agent.plugins import declared
from workbench.agent.static_check import check_file
from workbench.noise import bounded_band
from workbench.run_folder import write_json

SUSPECT = 0.8           # a step time below this fraction of the roofline floor is not believed
RECHECK_FRACTION = 1 / 16
RECHECK_SAMPLES = 4
MAX_COPIES = 64         # rotated input copies in checked timing, each from its own seed


@dataclass
class Task:
    """What one candidate is judged on (plain data: it travels to the worker as JSON)."""

    point: str
    name: str                       # the variant the candidate file must register
    workloads: dict                 # kind -> Workload
    calls: dict                     # kind -> calls per step
    incumbent: str = "torch"
    incumbent_config: dict | None = None
    incumbent_file: str | None = None   # the incumbent's module when it is not the package's (an agent's)
    gate_workloads: list = field(default_factory=list)  # gated besides `workloads` (a prefill chunk)
    device: str = "cpu"
    floor_us: float | None = None   # roofline floor of the point's calls in one step
    trust: bool = False
    seeds: int = 2
    timeout_s: float = 600.0
    mem_bytes: int = worker.DEFAULT_MEM_BYTES
    timing: dict = field(default_factory=dict)  # overrides of timing.time_call's arguments


@dataclass
class Verdict:
    accepted: bool
    stage: str          # static | load | worker | gate | recheck | suspect | not_faster | accepted
    reason: str
    static: list = field(default_factory=list)
    gate: dict | None = None
    failed_check: str | None = None
    timing: dict | None = None  # candidate_us, incumbent_us, band, speedup, floor_us
    suspect: bool = False
    recheck: dict | None = None
    worker: dict | None = None
    seed_base: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def judge(path: str, task: Task, *, work_dir: str) -> Verdict:
    """Judge the candidate at `path`; the worker's request, result and log go to `work_dir`."""
    violations = check_file(path, task.point)
    if violations:
        return Verdict(False, "static", "static check: " + "; ".join(str(v) for v in violations),
                       static=[v.to_dict() for v in violations])
    try:
        names = declared(path)
    except (OSError, SyntaxError) as e:
        return Verdict(False, "load", f"cannot read the candidate: {e}")
    if names != [(task.point, task.name)]:
        return Verdict(False, "load", f"the file must register exactly {task.point}:{task.name} "
                       f"(`@register(\"{task.point}\", \"{task.name}\", BACKEND)`), it registers {names}")
    seed_base = 1000 + secrets.randbelow(1 << 20) * 64  # fresh values each attempt
    os.makedirs(work_dir, exist_ok=True)
    request = {"file": os.path.abspath(path), "task": _task_dict(task), "seed_base": seed_base,
               "threads": _threads()}
    req_path, res_path = os.path.join(work_dir, "request.json"), os.path.join(work_dir, "result.json")
    if os.path.exists(res_path):
        os.remove(res_path)
    with open(req_path, "w") as f:
        json.dump(request, f, indent=1, default=str)
    ran = worker.run(f"{__name__}:worker_main", [req_path, res_path], timeout=task.timeout_s, mem_bytes=task.mem_bytes,
                     device=task.device, log_path=os.path.join(work_dir, "worker.log"))
    result = None
    if os.path.isfile(res_path):
        with open(res_path) as f:
            result = json.load(f)
    return decide(result, task, ran, seed_base)


def decide(result: dict | None, task: Task, ran: worker.Exit | None = None, seed_base: int | None = None) -> Verdict:
    """The verdict on a worker's result (None: it left none) and how the worker ended."""
    verdict = Verdict(False, "worker", "", worker=ran.to_dict() if ran else None, seed_base=seed_base)
    if result:
        verdict.gate, verdict.failed_check = result.get("gate"), result.get("failed_check")
        verdict.recheck = result.get("recheck")
    died = ran.reason if ran else None
    if died or not result or result.get("stage") not in ("gate", "load", "done"):
        stage = result.get("stage") if result else "start"
        verdict.reason = f"{died or 'the worker left no result'} (during {stage})"
        return verdict
    if result["stage"] == "load":
        verdict.stage, verdict.reason = "load", result.get("error", "the candidate did not load")
        return verdict
    if result["stage"] == "gate":
        verdict.stage, verdict.reason = "gate", f"op gate failed: {verdict.failed_check}"
        return verdict
    if verdict.recheck and verdict.recheck.get("failed"):
        verdict.stage = "recheck"
        verdict.reason = "outputs of timed calls were wrong: " + "; ".join(verdict.recheck["failed"][:3])
        return verdict
    cand, inc, band = result["candidate_us"], result["incumbent_us"], bounded_band(result["band"])
    verdict.timing = {"candidate_us": cand, "incumbent_us": inc, "band": band, "speedup": inc / cand,
                      "floor_us": task.floor_us, "per_kind": result.get("per_kind")}
    verdict.suspect = bool(task.floor_us) and cand < SUSPECT * task.floor_us
    if verdict.suspect and not task.trust:
        verdict.stage = "suspect"
        verdict.reason = (f"suspect: {cand:.3g} us per step is below {SUSPECT} x the roofline floor "
                          f"({task.floor_us:.3g} us); not locked without --trust")
        return verdict
    if cand >= inc * (1 - band):
        verdict.stage = "not_faster"
        verdict.reason = (f"not faster than {task.incumbent} beyond the noise band: {cand:.3g} us vs "
                          f"{inc:.3g} us (band {band:.1%})")
        return verdict
    verdict.accepted, verdict.stage = True, "accepted"
    verdict.reason = f"{inc / cand:.2f}x faster than {task.incumbent} ({cand:.3g} us vs {inc:.3g} us per step)"
    return verdict


def _task_dict(task: Task) -> dict:
    d = asdict(task)
    d["workloads"] = {k: dataclasses.asdict(w) for k, w in task.workloads.items()}
    d["gate_workloads"] = [dataclasses.asdict(w) for w in task.gate_workloads]
    return d


def _threads() -> int:
    import torch

    return torch.get_num_threads()


# ------------------------------------------------------------------------------ the worker's side

def checked_timing(variant, workload, *, device, seed_base: int, timing: dict, rng: random.Random | None,
                   config=None) -> tuple[dict, dict | None]:
    """timing.time_call on copies that each come from their own seed; with `rng`, a random sample of
    the timed calls runs poisoned and is re-checked against the reference afterwards.
    Returns (Timing.as_dict(), {"checked", "failed"} or None)."""
    import torch

    from workbench import gates
    from workbench.points import Call, spec
    from workbench.timing import time_call

    point_spec = spec(variant.point)
    plain: dict[int, object] = {}
    layout = {}

    def make_call(i: int) -> Call:
        call = point_spec.make_inputs(workload, device, seed_base + i)
        layout["weights_arg"] = call.weights_arg
        if call.weights_arg is None:
            return call
        prepared = variant.prepare_weights(call.args[call.weights_arg])
        plain[id(prepared)] = call.args[call.weights_arg]
        return call.with_weights(prepared)

    fn = variant.at(config)
    kept: list[tuple] = []
    poisoned = [0]

    def sampled(*args, **kwargs):
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if capturing or rng.random() >= RECHECK_FRACTION:
            return fn(*args, **kwargs)
        with gates._poisoned():
            out = fn(*args, **kwargs)
        poisoned[0] += 1
        if len(kept) < RECHECK_SAMPLES:
            kept.append((args, kwargs, out))
        else:
            j = rng.randrange(poisoned[0])
            if j < RECHECK_SAMPLES:
                kept[j] = (args, kwargs, out)
        return out

    kw = {"max_copies": MAX_COPIES, "make_seconds": math.inf, **timing}
    t = time_call(sampled if rng else fn, make_call, device=device,
                        touched_bytes=int(point_spec.bytes(workload)), **kw)
    if rng is None:
        return t.as_dict(), None
    failed = []
    tol = point_spec.tolerance[workload.dtype]
    hp = gates._hp_dtype(device, workload.dtype)
    for args, kwargs, out in kept:
        w = layout["weights_arg"]
        args = list(args)
        if w is not None:
            args[w] = plain.get(id(args[w]), args[w])
        call = Call(tuple(args), kwargs, w)
        try:
            ref, _ = gates._reference(variant.point, call, hp, device)
            for name, err, thr, ok, detail in gates._judge(point_spec, call, gates._outputs(out), ref, {}, {}, {},
                                                          tol, None):
                if not ok:
                    failed.append(f"{name} {detail} error {err} > {thr}")
        except Exception as e:  # wrong shapes or types in a timed output
            failed.append(gates._error_text(e))
    return t.as_dict(), {"checked": len(kept), "poisoned_calls": poisoned[0], "failed": failed}


def worker_main(request_path: str, result_path: str) -> int:
    """The worker side of `judge` (in `python -m workbench.agent.worker`): load, gate, time; write the result."""
    with open(request_path) as f:
        req = json.load(f)
    result: dict = {"stage": "start"}

    def save(**kw):
        result.update(kw)
        write_json(result_path, result, indent=1)

    import torch

    from workbench import registry
    from workbench.agent.plugins import PluginError, load_file
    from workbench.gates import op_gate
    from workbench.points import Workload

    torch.set_num_threads(req["threads"])
    task = req["task"]
    device = torch.device(task["device"])
    try:
        found = load_file(req["file"])
    except PluginError as e:
        save(stage="load", error=str(e))
        return 0
    variant = next((v for v in found if (v.point, v.name) == (task["point"], task["name"])), None)
    if variant is None:
        save(stage="load", error=f"the file does not register {task['point']}:{task['name']}")
        return 0
    workloads = {k: Workload(**w) for k, w in task["workloads"].items()}
    gated = list(workloads.values()) + [Workload(**w) for w in task["gate_workloads"]]
    base = req["seed_base"]
    save(stage="gate")
    report = op_gate(variant, gated, device=device, seeds=tuple(base + 2 * i for i in range(task["seeds"])))
    save(gate=report.to_dict(), failed_check=report.first_failure())
    if not report.passed:
        return 0
    save(stage="timing")
    if task["incumbent_file"]:
        load_file(task["incumbent_file"])
    incumbent = registry.get(task["point"], task["incumbent"])
    rng = random.Random(base)
    totals = {"inc1": 0.0, "cand": 0.0, "inc2": 0.0}
    per_kind, recheck = {}, {"checked": 0, "poisoned_calls": 0, "failed": []}
    for kind, wl in workloads.items():
        n = task["calls"][kind]
        seed = base + 10_000
        # The incumbent is sampled and poisoned the same way, so both pay the same overhead.
        i1, _ = checked_timing(incumbent, wl, device=device, seed_base=seed, timing=task["timing"],
                               rng=random.Random(base + 1), config=task["incumbent_config"])
        c, r = checked_timing(variant, wl, device=device, seed_base=seed, timing=task["timing"], rng=rng)
        i2, _ = checked_timing(incumbent, wl, device=device, seed_base=seed, timing=task["timing"],
                               rng=random.Random(base + 2), config=task["incumbent_config"])
        totals["inc1"] += n * i1["median_us"]
        totals["cand"] += n * c["median_us"]
        totals["inc2"] += n * i2["median_us"]
        per_kind[kind] = {"candidate_us": c["median_us"], "incumbent_us": min(i1["median_us"], i2["median_us"]),
                          "spread": c["spread"], "reps": c["reps"], "copies": c["copies"]}
        recheck["checked"] += r["checked"]
        recheck["poisoned_calls"] += r["poisoned_calls"]
        recheck["failed"] += [f"{kind}: {f}" for f in dict.fromkeys(r["failed"])]
    inc = min(totals["inc1"], totals["inc2"])
    band = abs(totals["inc1"] - totals["inc2"]) / inc if inc else 0.0
    save(stage="done", candidate_us=totals["cand"], incumbent_us=inc, band=band, per_kind=per_kind, recheck=recheck)
    return 0
