"""The judge's checks on its own timings: a candidate's step time must stand above an empty call's
(outputs of the contract's shapes copied into their slots, no work), timed in the same rounds through
the same sandbox path, else it is suspect; and the incumbent's time beside the candidate must agree
with the search's record of it or with its own time before the candidate started, else the candidate
is not accepted on a GPU (`off_record`; on the CPU the candidate is stopped while the incumbent is timed).

Each rule on the verdict alone (`decide`), then end to end on beam-tiny's `boundary` (FP32, CPU)
against a slow incumbent (the reference's math ten times), judged without the static check as the
red team's cheats are: one candidate computes every timed copy's outputs in helper processes as soon
as the copy's inputs change; another stops the other sandboxes' processes four fifths of the time; a
third forges the worker's result file as its process exits. The first two are beaten before these
checks see them: the candidate's processes are stopped whenever it is not timed (`pause.Pause`).
"""

import os
import sys

import pytest

from workbench.agent.judge import (
    ABOVE_EMPTY,
    ALONE_SLOWER,
    CPU_MIN_BAND,
    RECORD_SLOWER,
    Task,
    decide,
    judge,
    paired_ratio,
)
from workbench.points import Workload

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import scripted  # noqa: E402

TIMING = {"max_seconds": 0.3, "warmup": 1, "min_reps": 12}
WORKLOADS = {"sliding": Workload(dtype="fp32")}
INCUMBENT = "slow_timing"


def _task(**kw) -> Task:
    return Task("boundary", "x", WORKLOADS, {"sliding": 1}, **kw)


def _done(**kw) -> dict:
    return {"stage": "done", "candidate_us": 50.0, "incumbent_us": 100.0, "band": 0.02,
            "recheck": {"checked": 4, "failed": []}, **kw}


# ------------------------------------------------------------------------------ the verdict

def test_a_step_time_near_an_empty_calls_is_suspect():
    near = decide(_done(candidate_us=12.0, empty_us=10.0), _task(floor_us=0.5))
    assert not near.accepted and near.stage == "suspect" and near.suspect, near.reason
    assert "1.20 x an empty call's time" in near.reason and "10 us" in near.reason and "--trust" in near.reason
    assert near.timing["empty_us"] == 10.0
    assert decide(_done(candidate_us=12.0, empty_us=10.0), _task(floor_us=0.5, trust=True)).accepted
    assert decide(_done(candidate_us=ABOVE_EMPTY * 10.0 + 0.1, empty_us=10.0), _task(floor_us=0.5)).accepted
    # The higher of the two floors binds, and the reason names it.
    roofline = decide(_done(candidate_us=12.0, empty_us=10.0), _task(floor_us=40.0))
    assert roofline.stage == "suspect" and "0.30 x the roofline floor" in roofline.reason, roofline.reason


def test_no_time_at_all_is_suspect_not_a_crash():
    v = decide(_done(candidate_us=0.0), _task())
    assert v.stage == "suspect" and "no time at all" in v.reason and v.timing["speedup"] == float("inf"), v.reason


def test_a_speed_up_is_believed_only_past_its_confidence_interval():
    # Twelve rounds on a loaded machine: the median ratio says 1.2x faster, but a third of the rounds
    # had the candidate slower, so the median's interval reaches past 1 and nothing is accepted.
    noisy = [0.6, 0.7, 0.75, 0.8, 0.82, 0.83, 0.84, 1.05, 1.1, 1.2, 1.3, 1.4]
    ratio, noise = paired_ratio(noisy, [1.0] * 12)
    assert ratio == pytest.approx(0.835) and ratio + noise > 1.0
    v = decide(_done(candidate_us=100.0 * ratio, band=noise), _task())
    assert not v.accepted and v.stage == "not_faster" and v.timing["band"] == pytest.approx(noise), v.reason
    # The same median with every round faster is a speed-up.
    steady = [0.8, 0.81, 0.82, 0.83, 0.83, 0.835, 0.835, 0.84, 0.84, 0.85, 0.86, 0.9]
    ratio, noise = paired_ratio(steady, [1.0] * 12)
    assert ratio + noise < 0.9 and decide(_done(candidate_us=100.0 * ratio, band=noise), _task()).accepted


def test_a_few_percent_is_no_speed_up_on_the_cpu():
    """Two sandboxes doing the same work on a loaded CPU differ by a few percent for a whole judgement:
    on the CPU a gain is believed only past CPU_MIN_BAND, on a GPU past MIN_BAND."""
    steady = _done(candidate_us=95.0, band=0.01)  # 1.05x, every round alike
    v = decide(steady, _task())
    assert not v.accepted and v.stage == "not_faster" and v.timing["band"] == CPU_MIN_BAND, v.reason
    assert decide(steady, _task(device="cuda")).accepted
    assert decide(_done(candidate_us=85.0, band=0.01), _task()).accepted


def test_an_incumbent_slower_than_its_record_and_than_alone_is_not_believed():
    slowed = _done(candidate_us=150.0, incumbent_us=300.0, incumbent_alone_us=105.0, empty_alone_us=5.0)
    v = decide(slowed, _task(incumbent_record_us=100.0, trust=True, device="cuda"))  # --trust does not cover it
    assert not v.accepted and v.stage == "off_record", v.reason
    assert "300 us per step" in v.reason and "record of 100 us" in v.reason and "2.86 x" in v.reason
    assert v.timing["record_us"] == 100.0 and v.timing["incumbent_alone_us"] == 105.0
    # Within either bound it is noise: the load changed since the incumbent ran alone, or the record
    # was taken another way.
    assert decide({**slowed, "incumbent_alone_us": 300.0 / ALONE_SLOWER + 1.0},
                  _task(incumbent_record_us=100.0, device="cuda")).accepted
    assert decide(slowed, _task(incumbent_record_us=300.0 / RECORD_SLOWER - 4.0, device="cuda")).accepted
    assert decide(slowed, _task(device="cuda")).accepted  # no record, no check
    # On the CPU the candidate is stopped while the incumbent is timed: only the load can slow it there
    assert decide(slowed, _task(incumbent_record_us=100.0)).accepted


# ------------------------------------------------------------------------------ end to end

def _helpers(extra: str) -> str:
    return scripted.HEADER + extra + f"""

def _once(y, h, w, eps):
{scripted.REFERENCE_BODY}
"""


AHEAD = _helpers('''
import ctypes
import os
import signal
import time

_COPIES = {}  # id(y) -> (inputs' fingerprint, outputs, y, helper pid); the helper writes both (shared memory)


def _fingerprint(y, h):
    return (ctypes.c_float.from_address(y.data_ptr() + 4 * (y.numel() - 1)).value,
            ctypes.c_float.from_address(h.data_ptr() + 4 * (h.numel() - 1)).value)


def _help(y, h, w, eps, fp, outs, parent):
    while os.getppid() == parent:
        now = _fingerprint(y, h)
        if tuple(fp.tolist()) != now:
            got = _once(y, h, w, eps)
            if _fingerprint(y, h) == now:
                for o, g in zip(outs, got):
                    if g is not None:
                        o.copy_(g)
                fp.copy_(torch.tensor(now))
        time.sleep(0.0002)
    os._exit(0)
''') + '''

@register("boundary", "cheat", "torch")
def cheat(y, h, w, *, eps, group=None):
    got = _COPIES.get(id(y))
    if got is not None and got[2] is y and tuple(got[0].tolist()) == _fingerprint(y, h):
        return got[1]
    out = _once(y, h, w, eps)
    if got is None:
        fp = torch.full((2,), float("nan")).share_memory_()
        outs = tuple(None if o is None else o.clone().share_memory_() for o in out)
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            _help(y, h, w, eps, fp, outs, parent)
        _COPIES[id(y)] = (fp, outs, y, pid)
        while len(_COPIES) > 8:  # a timed round's copies keep theirs; the gate's calls' helpers go
            old = _COPIES.pop(next(iter(_COPIES)))
            os.kill(old[3], signal.SIGKILL)
            os.waitpid(old[3], 0)
    return out
'''

STOPS_THE_OTHERS = _helpers('''
import atexit
import os
import signal
import threading
import time

_STARTED = []


def _siblings():
    me, parent, found = os.getpid(), os.getppid(), []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me:
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == parent:
                        found.append(int(name))
            except (OSError, ValueError, IndexError):
                pass
    return found


def _signal(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _toggle(pids, done):
    while not done.is_set():
        _signal(pids, signal.SIGSTOP)
        time.sleep(0.004)
        _signal(pids, signal.SIGCONT)
        time.sleep(0.001)
''') + '''

@register("boundary", "cheat", "torch")
def cheat(y, h, w, *, eps, group=None):
    if not _STARTED:
        pids, done = _siblings(), threading.Event()
        _STARTED.append(threading.Thread(target=_toggle, args=(pids, done), daemon=True))
        _STARTED[0].start()
        atexit.register(lambda: (done.set(), _STARTED[0].join(), _signal(pids, signal.SIGCONT)))
    for _ in range(9):
        _once(y, h, w, eps)
    return _once(y, h, w, eps)
'''

FASTER = _helpers("") + '''

@register("boundary", "cheat", "torch")
def cheat(y, h, w, *, eps, group=None):
    return _once(y, h, w, eps)
'''


# Wrong (its outputs never computed), and rewrites the worker's result file as an accepted one as it exits.
FORGES_AT_EXIT = _helpers("") + '''

@register("boundary", "cheat", "torch")
def cheat(y, h, w, *, eps, group=None):
    import atexit, json, os
    parent = open(f"/proc/{os.getppid()}/cmdline").read().split("\\0")
    path = next(a for a in parent if a.endswith("result.json"))
    forged = {"stage": "done", "candidate_us": 1.0, "incumbent_us": 100.0, "band": 0.0,
              "recheck": {"checked": 1, "failed": []}}
    atexit.register(lambda: open(path, "w").write(json.dumps(forged)))
    return torch.zeros_like(h), None if w["next_norm"] is None else torch.zeros_like(h)
'''


@pytest.fixture(scope="module")
def incumbent(tmp_path_factory):
    path = tmp_path_factory.mktemp("incumbent") / f"boundary__{INCUMBENT}.py"
    path.write_text(scripted.slow(INCUMBENT))
    return str(path)


@pytest.fixture(scope="module")
def record_us(incumbent):
    """The incumbent's step time as the search records it: timed in this process (the faster of three)."""
    from workbench import bench
    from workbench.agent import plugins

    found = plugins.load_file(incumbent)
    try:
        return min(bench.time_variant(found[0], WORKLOADS["sliding"], **TIMING)["median_us"] for _ in range(3))
    finally:
        plugins.unload(found)


def judged(tmp_path, incumbent, source: str, record_us: float | None = None):
    path = tmp_path / "boundary__cheat.py"
    path.write_text(source)
    task = Task("boundary", "cheat", WORKLOADS, {"sliding": 1}, incumbent=INCUMBENT, incumbent_file=incumbent,
                timeout_s=120, timing=TIMING, seeds=1, incumbent_record_us=record_us)
    return judge(str(path), task, work_dir=str(tmp_path / "work"), static_check=False)


def test_outputs_cannot_be_made_ahead_of_the_timed_calls(tmp_path, incumbent):
    """The helpers are stopped whenever the candidate is not timed, so its timed calls do the work: its
    time stands above an empty call's (were the outputs made ahead, it would be near it: suspect)."""
    v = judged(tmp_path, incumbent, AHEAD)
    assert v.stage in ("accepted", "not_faster"), v.reason
    assert v.timing["candidate_us"] >= ABOVE_EMPTY * v.timing["empty_us"], v.timing
    assert v.recheck["checked"] > 0 and not v.recheck["failed"]


def test_a_candidate_cannot_slow_the_incumbent(tmp_path, incumbent, record_us):
    """Its thread that stops the other sandboxes is itself stopped while they are timed, and they are
    continued before: the same work as the incumbent's is not faster, nor is the incumbent off its record."""
    v = judged(tmp_path, incumbent, STOPS_THE_OTHERS, record_us)
    assert not v.accepted and v.stage == "not_faster", v.reason


def test_a_trusted_boxs_timing_path_is_taken_warm():
    """What the timing path costs is an empty round trip's time as warm as the batch after it: the first
    of two wakes a box that sat idle through the other boxes' rounds."""
    from workbench.agent.judge import _run_batch

    class Box:
        pid, trips = 1, iter([5e-4, 5e-5])  # cold, then warm

        def empty_round_trip(self):
            return next(self.trips)

        def run_batch(self, name, order):
            return 1e-4

    assert _run_batch(Box(), "incumbent", 8, None) == (1e-4, 5e-5)


def test_an_honest_faster_candidate_passes_both_checks(tmp_path, incumbent, record_us):
    v = judged(tmp_path, incumbent, FASTER, record_us)
    assert v.accepted and v.timing["speedup"] > 1, v.reason
    t = v.timing
    assert t["candidate_us"] >= ABOVE_EMPTY * t["empty_us"] > 0
    assert t["record_us"] == record_us and t["incumbent_alone_us"] > 0 and t["empty_alone_us"] > 0


def test_a_result_forged_as_the_candidate_exits_is_overwritten(tmp_path, incumbent):
    """The worker writes its result once more after every sandbox has ended, on every path: here the
    gate fails and the candidate's process exits after the worker's last word."""
    v = judged(tmp_path, incumbent, FORGES_AT_EXIT)
    assert not v.accepted and v.stage == "gate" and "accuracy" in str(v.failed_check), v.reason
