"""The judge of a candidate variant file: static check -> sandboxed gates and paired timing -> sanity.

`judge(path, task)` returns a `Verdict`: accepted, or the stage that rejected it and why.
1. Static check (`static_check`), and the file must register exactly the task's `point:name`.
2. In a worker process (`worker.run`, time and memory limits), which never imports the candidate: its
   code runs only in a sandbox process of its own (`sandbox.Sandbox`), the worker holding the clock,
   the inputs, the reference, the tolerances and the result file. Before the candidate's sandbox
   starts, the incumbent and an empty call are timed alone (`alone_times`); the empty call
   (`EMPTY_SOURCE`, a sandbox of its own) returns outputs of the contract's shapes made once, so it
   costs what any call costs through this timing path and nothing of the op. The op gate at the
   task's workloads and at a larger batch drawn for this attempt (`larger_batch`), on seeds drawn
   fresh for it, each call run plain and poisoned in the sandbox and compared bit for bit; then the
   incumbent, the candidate and the empty call timed in rounds interleaved in a random order
   (`sandboxed_timing`): every round refills the input copies with fresh values, and a random sample
   of the candidate's outputs is re-checked against the reference after it (a variant right in the
   gate and wrong once timing starts fails). Every process the candidate may have started is stopped
   except during its own rounds (`pause.Pause`): nothing of it runs while the others are timed.
3. On a GPU, not believed, whatever `trust` says, while the incumbent's time beside the candidate is
   past RECORD_SLOWER x the search's record of it (plus the empty call's time) and past ALONE_SLOWER x
   its time alone (`off_record`): the candidate slowed it (work it left queued on the device).
4. A step time below SUSPECT x the roofline floor or below ABOVE_EMPTY x the empty call's, whichever
   is higher, is flagged suspect (`suspect_floor`): not accepted without `trust`.
5. Accepted only if faster than the incumbent beyond the noise band: the candidate's step time is the
   incumbent's times the median of their round-by-round ratios (`paired_ratio`), the band how far
   the upper end of that median's 95% confidence interval lies above it, at least MIN_BAND (CPU_MIN_BAND
   on the CPU) and with no upper cap (a noisy timing is no evidence of a speed-up).
A crash, hang or CUDA error in the worker is a rejection with the reason; never an exception here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import secrets
import statistics
import tempfile
from dataclasses import asdict, dataclass, field

from workbench.agent import worker
from workbench.agent.pause import Pause, adopt_orphans
from workbench.agent.plugins import declared
from workbench.agent.static_check import check_file
from workbench.noise import MIN_BAND
from workbench.run_folder import write_json

SUSPECT = 0.8           # a step time below this fraction of the roofline floor is not believed
# A step time below this multiple of the empty call's is not believed. Measured on beam-tiny, 2 CPU
# cores, under load 1-6: a candidate whose outputs helper processes made ahead of its calls at 0.7-1.3x
# (2.1x once, at load 6); honest faster boundary variants at 1.9-6.3x; the smallest references
# (qkvg_proj, attn_out) at 1.8-3.5x.
ABOVE_EMPTY = 1.5
# An incumbent beside the candidate past both is slowed (`off_record`). Measured there: over (record +
# empty call alone), honest 0.7-1.6 for the red team's slow incumbent (2.3 in one load spike that slowed
# the candidate as much) and 1.0-3.1 for the references; over its time alone, honest 0.4-2.0; stopped
# by the candidate four fifths of the time, 6.3-7.9 and 5.0-6.3. A 2x slowdown is within this noise.
RECORD_SLOWER = 2.5
ALONE_SLOWER = 2.0
# The least gain believed on the CPU. Two sandboxes doing the same work on a loaded 2-core machine differ
# by several percent for a whole judgement, consistently enough to pass the interval test: the red
# team's clock-patching cheat, which runs the incumbent's own work, was accepted at 1.04x in CI.
CPU_MIN_BAND = 0.10
EMPTY = "judge_empty"   # the empty call's variant name, in its own sandbox
RECHECK_SAMPLES = 2     # candidate outputs re-checked against the reference after each timed round
COPIES = 8              # input copies a timed round runs, each refilled with fresh values every round
MAX_ROUNDS = 200
LARGER_BATCHES = (49, 160)  # the gate's extra batch, drawn per attempt: past every shape it gates otherwise


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
    incumbent_record_us: float | None = None    # the search's step time of the incumbent (`off_record`)


@dataclass
class Verdict:
    accepted: bool
    stage: str          # static | load | worker | gate | recheck | suspect | not_faster | off_record | accepted
    reason: str
    static: list = field(default_factory=list)
    gate: dict | None = None
    failed_check: str | None = None
    timing: dict | None = None  # candidate_us, incumbent_us, band, speedup, floor_us, empty_us, record_us, *_alone_us
    suspect: bool = False
    recheck: dict | None = None
    worker: dict | None = None
    seed_base: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def judge(path: str, task: Task, *, work_dir: str, static_check: bool = True) -> Verdict:
    """Judge the candidate at `path`; the worker's request, result and log go to `work_dir`. Without
    `static_check` (the red-team tests only) the defences behind it are judged on their own."""
    violations = check_file(path, task.point) if static_check else []
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
               "threads": _threads(), "static_check": static_check}
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
    least = CPU_MIN_BAND if task.device == "cpu" else MIN_BAND
    cand, inc, band = result["candidate_us"], result["incumbent_us"], max(least, result["band"])
    empty = result.get("empty_us")
    verdict.timing = {"candidate_us": cand, "incumbent_us": inc, "band": band,
                      "speedup": inc / cand if cand > 0 else math.inf,
                      "floor_us": task.floor_us, "empty_us": empty, "record_us": task.incumbent_record_us,
                      "incumbent_alone_us": result.get("incumbent_alone_us"),
                      "empty_alone_us": result.get("empty_alone_us"), "per_kind": result.get("per_kind")}
    # A slowed incumbent comes first: whatever slowed it slowed the empty call too, so no time of these
    # rounds holds, the floor included.
    # Only on a device: on the CPU nothing of the candidate runs while the incumbent is timed (`Pause`),
    # so an incumbent off its record there is the machine's load, not the candidate's doing.
    why = off_record(inc, task.incumbent_record_us, result.get("incumbent_alone_us"),
                     result.get("empty_alone_us")) if task.device != "cpu" else None
    if why:
        verdict.stage, verdict.reason = "off_record", f"the incumbent's time is not believed: {why}"
        return verdict
    why = suspect_floor(cand, task.floor_us, empty)
    verdict.suspect = why is not None
    if verdict.suspect and not task.trust:
        verdict.stage, verdict.reason = "suspect", f"suspect: {why}; not locked without --trust"
        return verdict
    if cand >= inc * (1 - band):
        verdict.stage = "not_faster"
        verdict.reason = (f"not faster than {task.incumbent} beyond the noise band: {cand:.3g} us vs "
                          f"{inc:.3g} us (band {band:.1%})")
        return verdict
    verdict.accepted, verdict.stage = True, "accepted"
    verdict.reason = (f"{verdict.timing['speedup']:.2f}x faster than {task.incumbent} ({cand:.3g} us vs "
                      f"{inc:.3g} us per step)")
    return verdict


def suspect_floor(cand_us: float, floor_us: float | None, empty_us: float | None) -> str | None:
    """Why a candidate's `cand_us` per step is not believed, or None. Two floors, the higher binds: the
    roofline's (what the bytes and flops cost at the device's peaks) and the empty call's (what any call
    costs through the sandbox's timing path, measured beside it: for a tiny op the higher one by far)."""
    floors = [(SUSPECT * floor_us, SUSPECT, "the roofline floor", floor_us)] if floor_us else []
    floors += [(ABOVE_EMPTY * empty_us, ABOVE_EMPTY, "an empty call's time (outputs copied, no work)",
                empty_us)] if empty_us else []
    if cand_us <= 0:
        return "no time at all per step is not believed"
    if not floors:
        return None
    bound, factor, what, us = max(floors)
    if cand_us >= bound:
        return None
    return f"{cand_us:.3g} us per step is {cand_us / us:.2f} x {what}, {us:.3g} us; below {factor} x it is not believed"


def off_record(incumbent_us: float, record_us: float | None, alone_us: float | None,
               empty_alone_us: float | None) -> str | None:
    """Why the incumbent's `incumbent_us` per step beside the candidate is not believed, or None: past
    RECORD_SLOWER x its search record `record_us` (timed in process, so with `empty_alone_us` added,
    what a call costs through the sandbox) and past ALONE_SLOWER x `alone_us`, its own time here
    before any candidate code ran. Neither is within the candidate's reach; the record misses costs of
    this path beyond the empty call's, the alone time a load that changed since: past both, the
    incumbent was slowed."""
    if not record_us:
        return None
    expected = record_us + (empty_alone_us or 0.0)
    if incumbent_us <= RECORD_SLOWER * expected or (alone_us and incumbent_us <= ALONE_SLOWER * alone_us):
        return None
    alone = f" and {incumbent_us / alone_us:.2f} x its {alone_us:.3g} us before the candidate started" \
        if alone_us else ""
    return (f"it took {incumbent_us:.3g} us per step beside the candidate, {incumbent_us / expected:.2f} x its "
            f"search record of {record_us:.3g} us (+ {empty_alone_us or 0.0:.3g} us an empty call costs here)"
            f"{alone}: something slowed it while it was timed (work the candidate left running)")


def _task_dict(task: Task) -> dict:
    d = asdict(task)
    d["workloads"] = {k: dataclasses.asdict(w) for k, w in task.workloads.items()}
    d["gate_workloads"] = [dataclasses.asdict(w) for w in task.gate_workloads]
    return d


def _threads() -> int:
    import torch

    return torch.get_num_threads()


# ------------------------------------------------------------------------------ the worker's side

def _shared(call):
    """`call` with its CPU tensors moved to shared memory (in place), so a sandbox reads and writes them."""
    import torch

    from workbench.points import named_leaves

    for _, t in named_leaves(call):
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            t.share_memory_()
    return call


def sandboxed_timing(boxes: dict, workload, *, device, rng: random.Random, timing: dict) -> tuple[dict, dict]:
    """Each sandbox's time per call at `workload`, the runs interleaved in a random order per round, on
    COPIES input copies whose activations get fresh values before every round, with a random sample of
    the candidate's outputs (`boxes["candidate"]`) re-checked against the reference after each round,
    less what the timing path costs: the least of the empty round trips the trusted boxes make before
    each of their rounds (many, so a loaded moment does not set it; never the candidate's, which could
    slow its own to shrink its times). Returns ({name: {"median_us", "rounds", "copies", "round_us"}},
    {"checked", "failed"})."""
    import time

    import torch

    from workbench import gates
    from workbench.points import Call, named_leaves, spec

    point = next(iter(boxes.values())).point
    point_spec = spec(point)
    copies = int(timing.get("copies", COPIES))
    seeds = iter(lambda: rng.randrange(1 << 40), None)
    base = [_shared(point_spec.make_inputs(workload, device, next(seeds))) for _ in range(copies)]
    w = base[0].weights_arg
    reference = gates._outputs(gates._reference(point, base[0], None, device)[0])  # the slots' shapes
    per_box = {}
    for name, box in boxes.items():  # each sandbox its prepared weights and its own output slots
        calls = [c if w is None else c.with_weights(box.prepare(c.args[w]) if box.info["prepare"] else c.args[w])
                 for c in base]
        slots = [[None if r is None else torch.empty_like(r).share_memory_() if r.device.type == "cpu"
                  else torch.empty_like(r) for r in reference] for _ in base]
        box.prepare_batch(name, calls, slots)
        per_box[name] = slots
    times = {name: [] for name in boxes}
    trips: list[float] = []  # the trusted boxes' empty round trips, one before each of their batches
    failed, checked, rounds = [], 0, 0
    warmup, min_rounds = int(timing.get("warmup", 2)), int(timing.get("min_reps", 10))
    budget, started = float(timing.get("max_seconds", 2.0)), time.monotonic()
    # the candidate's re-checks at the tolerance its gate held it to (a W8A8 candidate: its point's for that)
    declared = boxes["candidate"].info["activations"] if "candidate" in boxes else None
    tol = point_spec.tolerance_for(workload.dtype, declared, workload.weights)
    pause = Pause([b.pid for n, b in boxes.items() if n != "candidate"]) if "candidate" in boxes else None
    with pause or contextlib.nullcontext():
        while rounds < warmup + min_rounds or (time.monotonic() - started < budget and rounds < MAX_ROUNDS):
            for c in base:  # fresh activation values, same tensors: nothing computed before this round pays
                fresh = point_spec.make_inputs(workload, device, next(seeds))
                for (path, old), (_, new) in zip(named_leaves(c), named_leaves(fresh)):
                    if isinstance(old, torch.Tensor) and not path.startswith(f"args[{w}]"):
                        old.copy_(new)
            order = list(boxes)
            rng.shuffle(order)
            for name in order:
                seconds, trip = _run_batch(boxes[name], name, copies, pause)
                trips += [] if trip is None else [trip]
                if rounds >= warmup:
                    times[name].append(seconds)
            rounds += 1
            if "candidate" not in per_box:
                continue
            for i in rng.sample(range(copies), min(RECHECK_SAMPLES, copies)):
                checked += 1
                call = Call(base[i].args, base[i].kwargs, w)
                try:
                    ref, _ = gates._reference(point, call, gates._hp_dtype(device, workload.dtype), device)
                    for cname, err, thr, ok, detail in gates._judge(point_spec, call, per_box["candidate"][i], ref,
                                                                   {}, {}, {}, tol, None):
                        if not ok:
                            failed.append(f"{cname} {detail} error {err} > {thr}")
                except Exception as e:  # noqa: BLE001 - wrong shapes or types in a timed output
                    failed.append(gates._error_text(e))
    path_s = min(trips) if trips else 0.0
    per_call = {name: [max(x - path_s, 0.0) / copies * 1e6 for x in t] for name, t in times.items()}
    medians = {name: {"median_us": statistics.median(t), "rounds": len(t), "copies": copies, "round_us": t}
               for name, t in per_call.items()}
    return medians, {"checked": checked, "failed": list(dict.fromkeys(failed))}


def _run_batch(box, name: str, copies: int, pause) -> tuple[float, float | None]:
    """`box`'s round: the seconds of its batch's round trip, and for a trusted box (any but the
    candidate) an empty round trip's just before it. The candidate's processes run only during its own
    round (`pause`, None when no candidate is timed); a trusted box is continued first, in case the
    candidate stopped it."""
    if name == "candidate":
        pause.resume()
        try:
            return box.run_batch(name, list(range(copies))), None
        finally:
            pause.stop()
    if pause is not None:
        pause.release(box.pid)
    # The first trip wakes a process that sat idle through the other boxes' rounds, and on a loaded CPU a
    # cold trip costs several times a warm one; the second is as warm as the batch after it, so it is the
    # one taken off the batches (a cold one would take more than an empty call's rounds cost).
    box.empty_round_trip()
    trip = box.empty_round_trip()
    return box.run_batch(name, list(range(copies))), trip


def paired_ratio(candidate_us: list[float], incumbent_us: list[float]) -> tuple[float, float]:
    """The median of the candidate's time over the incumbent's, round by round (each pair ran back to
    back, so drift in the machine's speed cancels), and its noise: how far the upper end of the median's
    ~95% confidence interval lies above it. The interval is distribution-free (the sign test's: the
    median lies below the k-th smallest of n ratios with binomial(n, 1/2) odds), since a loaded
    machine's ratios are neither normal nor symmetric; with few rounds it reaches the largest ratio."""
    ratios = sorted(c / i for c, i in zip(candidate_us, incumbent_us) if i > 0)
    median, n = statistics.median(ratios), len(ratios)
    upper = min(n - 1, math.ceil(n / 2 + 0.98 * math.sqrt(n)))
    return median, ratios[upper] - median


def larger_batch(workload, rng: random.Random):
    """`workload` at a batch drawn per attempt from LARGER_BATCHES (decode rows, or prompt chunks of
    prefill): a variant that is right only at the shapes it expects to be gated at meets one it cannot
    know in advance."""
    return dataclasses.replace(workload, batch=max(workload.batch, rng.randint(*LARGER_BATCHES)))


def worker_main(request_path: str, result_path: str) -> int:
    """The worker side of `judge` (in `python -m workbench.agent.worker`): gate and time the candidate,
    which runs only in its sandbox (`sandbox.Sandbox`), never here; write the result."""
    with open(request_path) as f:
        req = json.load(f)
    result: dict = {"stage": "start"}

    def save(**kw):
        result.update(kw)
        write_json(result_path, result, indent=1)

    try:
        _gate_and_time(req, save)
    finally:
        save()  # once more after every sandbox has ended: what candidate code wrote over the file is gone
    return 0


def _gate_and_time(req: dict, save) -> None:
    import torch

    from workbench.agent.sandbox import Sandbox, SandboxError
    from workbench.gates import op_gate
    from workbench.points import Workload

    # No thread of this process or of an idle sandbox may spin while a box is timed: OpenMP threads
    # spin after each parallel op, keeping the cores from the box timed next (beam-tiny's head on 2
    # cores timed at 60-120x its cost; the re-checks' references slowed the rounds after them). This
    # process works single-threaded; the sandboxes' threads sleep when idle.
    torch.set_num_threads(1)
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    adopt_orphans()  # what the candidate starts stays under this process, where `Pause` stops it
    task = req["task"]
    device = torch.device(task["device"])
    common = dict(device=task["device"], threads=req["threads"])
    workloads = {k: Workload(**w) for k, w in task["workloads"].items()}
    rng = random.Random(secrets.randbits(64))  # the rounds' order, the fresh values and the re-checks
    with Sandbox(task["point"], task["incumbent"], file=task["incumbent_file"], config=task["incumbent_config"],
                 **common) as incumbent, tempfile.TemporaryDirectory() as tmp, \
            Sandbox(task["point"], EMPTY, file=_empty_file(tmp, task["point"]), static_check=False, **common) as empty:
        save(**alone_times({"incumbent": incumbent, "empty": empty}, workloads, task, device=device, rng=rng))
        try:
            candidate = Sandbox(task["point"], task["name"], file=req["file"], static_check=req["static_check"],
                                **common)
        except SandboxError as e:
            save(stage="load", error=str(e))
            return
        with candidate:
            gated = list(workloads.values()) + [Workload(**w) for w in task["gate_workloads"]]
            gated.append(larger_batch(next(iter(workloads.values())), random.Random(secrets.randbits(64))))
            base = req["seed_base"]
            save(stage="gate")
            report = op_gate(candidate.variant(), gated, device=device,
                             seeds=tuple(base + 2 * i for i in range(task["seeds"])))
            save(gate=report.to_dict(), failed_check=report.first_failure())
            if not report.passed:
                return
            save(stage="timing")
            boxes = {"incumbent": incumbent, "candidate": candidate, "empty": empty}
            save(stage="done", **step_times(boxes, workloads, task, device=device, rng=rng))


EMPTY_SOURCE = '''import torch

from workbench import registry

_MADE = {{}}  # the arguments' ids -> (the arguments, kept so no id is reused; the reference's outputs)


@registry.register("{point}", "{name}", "torch")
def empty(*args, **kwargs):
    key = tuple(id(a) for a in args)
    if key not in _MADE:
        with torch.no_grad():
            _MADE[key] = args, registry.reference("{point}").fn(*args, **kwargs)
    return _MADE[key][1]
'''


def _empty_file(folder: str, point: str) -> str:
    """The empty call of `point` as a variant module in `folder`: the reference's outputs for each input
    copy, made on its first (warm-up) round and returned as they are after that, so a timed call costs
    the sandbox's path and the copy into the output slots, and nothing of the op."""
    path = os.path.join(folder, f"{point}__{EMPTY}.py")
    with open(path, "w") as f:
        f.write(EMPTY_SOURCE.format(point=point, name=EMPTY))
    return path


def alone_times(boxes: dict, workloads: dict, task: dict, *, device, rng: random.Random) -> dict:
    """The incumbent's and the empty call's step times before any candidate code has run (its sandbox
    not started yet): what `off_record` holds the incumbent's time beside the candidate to."""
    inc = empty = 0.0
    for kind, wl in workloads.items():
        times, _ = sandboxed_timing(boxes, wl, device=device, rng=rng, timing=task["timing"])
        inc_us = times["incumbent"]["median_us"]
        inc += task["calls"][kind] * inc_us
        empty += task["calls"][kind] * inc_us * paired_ratio(times["empty"]["round_us"],
                                                            times["incumbent"]["round_us"])[0]
    return {"incumbent_alone_us": inc, "empty_alone_us": empty}


def step_times(boxes: dict, workloads: dict, task: dict, *, device, rng: random.Random) -> dict:
    """Per step, summed over the point's calls: the incumbent's time, the candidate's and the empty
    call's (each the incumbent's times the median of their round-by-round ratios to it), the band,
    and the candidate's re-checks."""
    inc = cand = empty = spread = 0.0
    per_kind, recheck = {}, {"checked": 0, "failed": []}
    for kind, wl in workloads.items():
        n = task["calls"][kind]
        times, r = sandboxed_timing(boxes, wl, device=device, rng=rng, timing=task["timing"])
        ratio, noise = paired_ratio(times["candidate"]["round_us"], times["incumbent"]["round_us"])
        empty_ratio, _ = paired_ratio(times["empty"]["round_us"], times["incumbent"]["round_us"])
        inc_us = times["incumbent"]["median_us"]
        inc, cand, spread = inc + n * inc_us, cand + n * inc_us * ratio, spread + n * inc_us * noise
        empty += n * inc_us * empty_ratio
        per_kind[kind] = {"candidate_us": times["candidate"]["median_us"], "incumbent_us": inc_us,
                          "empty_us": times["empty"]["median_us"], "paired_ratio": ratio,
                          "rounds": times["candidate"]["rounds"], "copies": times["candidate"]["copies"]}
        recheck["checked"] += r["checked"]
        recheck["failed"] += [f"{kind}: {f}" for f in r["failed"]]
    return {"candidate_us": cand, "incumbent_us": inc, "empty_us": empty, "band": spread / inc if inc else 0.0,
            "per_kind": per_kind, "recheck": recheck}
