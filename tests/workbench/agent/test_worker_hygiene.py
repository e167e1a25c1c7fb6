"""Nothing a worker or an agent command starts outlives it (issue 49, class 5: processes escape).

- Whatever candidate code forks, even a double-forked grandchild that left the group with setsid, is
  gone when `worker.run` returns, however the worker ended: a return, os._exit, the time limit, the
  memory limit, a supervisor killed from outside.
- A SIGTERM or SIGINT to `workbench check` (or any caller of `worker.run`) ends the worker and its
  temporary folder, then the command exits 128 + the signal (or the caller's own handler runs).
- A worker that exits 0 without its completion sentinel (`sys.exit(0)`, `os._exit(0)` in candidate
  code) is a failure, never a pass.
- `optimize --agent`: the agent command's own failure (non-zero exit, a signal, its budget) is the
  attempt's outcome, an untouched scaffold is never judged, and what the agent started is ended.
- `--worker-timeout` / `--worker-memory` on check, bench and optimize reach the worker.

Entry points are `builtins:exec` on a code string, so most workers here import no torch (~0.1 s each).
"""

import os
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from workbench.agent import worker
from workbench.cli import main

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process hygiene is checked on Linux")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))


def _alive(pid: int) -> bool:
    """Running (a zombie is dead: it only waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return out


def _worker_folders(tmp) -> list:
    return [p.name for p in tmp.iterdir() if p.name.startswith("workbench-worker-")]


def _wait_for(predicate, timeout: float = 30.0, what: str = "the condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


# A candidate-like entry: a child and a setsid'd grandchild (double fork) that each note their pid, sleep,
# then write a file; the entry waits until both have noted theirs, then ends as END says.
FORKS = textwrap.dedent('''
    def forks(d):
        import os, time
        def later(name):
            with open(os.path.join(d, name + ".pid"), "w") as f:
                f.write(str(os.getpid()))
            time.sleep(3)
            with open(os.path.join(d, name + ".late"), "w") as f:
                f.write("escaped")
            os._exit(0)
        if os.fork() == 0:
            later("child")
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                later("grandchild")
            os._exit(0)
        while not all(os.path.exists(os.path.join(d, n + ".pid")) for n in ("child", "grandchild")):
            time.sleep(0.01)
    forks({d!r})
    {end}
''')

ENDS = {  # how the worker ends -> (its code line, (returncode, killed, finished))
    "returns": ("", (0, None, True)),
    "os._exit": ("import os; os._exit(0)", (0, None, False)),
    "timeout": ("import time; time.sleep(60)", (None, "timeout", False)),
    # the entry may write its sentinel before its parent-death signal lands: `finished` either way
    "supervisor_killed": ("import os, signal; os.kill(os.getppid(), signal.SIGKILL)", (-9, None, None)),
}


@pytest.mark.parametrize("how", sorted(ENDS))
def test_nothing_the_worker_started_outlives_it(tmp_path, how):
    end, (code, killed, finished) = ENDS[how]
    started = time.monotonic()
    ran = worker.run("builtins:exec", [FORKS.format(d=str(tmp_path), end=end)], timeout=1.5)
    assert time.monotonic() - started < 10
    assert ran.killed == killed and finished in (None, ran.finished), ran
    assert (ran.reason is None) == (code == 0 and finished is True), ran
    if code is not None:
        assert ran.returncode == code, ran
    pids = {n: int((tmp_path / f"{n}.pid").read_text()) for n in ("child", "grandchild")}
    assert not [n for n, pid in pids.items() if _alive(pid)], f"{how}: still running after run() returned"
    time.sleep(0.1)
    assert not list(tmp_path.glob("*.late"))


def test_the_memory_watch_is_on_the_entrys_process(tmp_path):
    """The worker's direct child is the supervisor (a few MB); the resident-memory limit (the GPU's, no
    RLIMIT_AS) watches the process that runs the entry, and ends the tree with it."""
    hog = FORKS.format(d=str(tmp_path), end="x = b'x' * (400 << 20)\nimport time; time.sleep(60)")
    ran = worker.run("builtins:exec", [hog], timeout=30, mem_bytes=200 << 20, device="cuda")
    assert ran.killed == "memory" and "memory" in ran.reason and ran.seconds < 20, ran
    assert not [p for p in tmp_path.glob("*.pid") if _alive(int(p.read_text()))]


# ------------------------------------------------------------------------------ completion sentinel

@pytest.mark.parametrize("code", ["import os; os._exit(0)", "import sys; sys.exit(0)", "raise SystemExit"])
def test_an_exit_0_without_the_completion_sentinel_is_a_failure(code):
    ran = worker.run("builtins:exec", [f"print('half done', flush=True)\n{code}\nprint('never')"], timeout=30)
    assert ran.returncode == 0 and not ran.finished and ran.killed is None
    assert ran.reason == worker.NO_SENTINEL
    done = worker.run("builtins:exec", ["print('all done')"], timeout=30)
    assert (done.returncode, done.finished, done.reason) == (0, True, None)


def test_the_sentinel_token_is_not_in_the_workers_environment_or_arguments():
    probe = ("import os, sys\n"
             f"assert {worker.FDS_ENV!r} not in os.environ and {worker.PARENT_ENV!r} not in os.environ\n"
             f"assert os.environ[{worker.RUN_ENV!r}]\n")
    ran = worker.run("builtins:exec", [probe], timeout=30)
    assert ran.finished, ran


def test_the_judge_never_accepts_a_worker_without_its_sentinel():
    from workbench.agent.judge import Task, decide
    from workbench.points import Workload

    result = {"stage": "done", "candidate_us": 1.0, "incumbent_us": 100.0, "band": 0.01,
              "recheck": {"checked": 4, "failed": []}}
    task = Task("boundary", "x", {"sliding": Workload(dtype="fp32")}, {"sliding": 1})
    ran = worker.Exit(0, 1.0, None, worker.NO_SENTINEL, "", False)
    verdict = decide(result, task, ran)
    assert not verdict.accepted and worker.NO_SENTINEL in verdict.reason


PLUGIN = '''import torch
from workbench.registry import register


@register("boundary", "{name}", "torch")
def boundary_{name}(y, h, w, *, eps, group=None):
{body}
'''
CHECK = ["--batch", "1", "--prefill", "0", "0", "0", "--seeds", "1", "--no-capture", "--context", "64", "32"]


def _plugin(tmp_path, name: str, body: str) -> str:
    d = tmp_path / "plugins"
    d.mkdir(exist_ok=True)
    (d / f"boundary__{name}.py").write_text(PLUGIN.format(name=name, body=textwrap.indent(body, "    ")))
    return str(d)


# Loaded at start-up by every Python process under PYTHONPATH: in a worker, the import of the gates ends the
# process with status 0 mid-command, as a library's or native code's exit(0) would.
EXITS_MID_COMMAND = """import importlib.abc, os, sys


class _ExitAtTheGates(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "workbench.gates" and os.environ.get("BEAM_WORKBENCH_WORKER") == "1":
            print("exiting with status 0 mid-command", flush=True)
            {how}


sys.meta_path.insert(0, _ExitAtTheGates())
"""


@pytest.mark.parametrize("how", ["os._exit(0)", "sys.exit(0)"])
def test_check_fails_when_its_worker_exits_0_mid_command(tmp_path, monkeypatch, capsys, how):
    """A worker that exits 0 mid-gate is not a pass: `workbench check --dir` fails and says why."""
    from workbench.agent import scaffold

    d = tmp_path / "plugins"
    d.mkdir()
    (d / "boundary__fine.py").write_text(scaffold.render("boundary", "fine", "torch"))
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(EXITS_MID_COMMAND.format(how=how))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), ROOT]))
    assert main(["check", "boundary:fine", "--dir", str(d), *CHECK]) == 1
    out = capsys.readouterr()
    assert "exiting with status 0 mid-command" in out.out and worker.NO_SENTINEL in out.err


# ------------------------------------------------------------------------------ stopped from outside

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_check_leaves_no_worker_and_no_temporary_folder(tmp_path, sig):
    d = _plugin(tmp_path, "spins", "print('spinning', flush=True)\nwhile True:\n    pass")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": ROOT}
    # `python -m workbench.cli check ...`, with Python's own SIGINT handler even where this process ignores SIGINT
    cli_main = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                "from workbench.cli import main; sys.exit(main(sys.argv[1:]))")
    cli = subprocess.Popen([sys.executable, "-c", cli_main, "check", "boundary:spins", "--dir", d, *CHECK],
                           env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        supervisor = _wait_for(lambda: next(iter(_children(cli.pid)), None), what="the worker")
        entry = _wait_for(lambda: next(iter(_children(supervisor)), None), what="the worker's entry")
        assert cli.stdout.readline() == "spinning\n"  # the worker is gating the variant, which never returns
        assert _worker_folders(tmp), "the command's temporary folder"
        cli.send_signal(sig)
        err = cli.communicate(timeout=30)[1]
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert cli.returncode == 128 + sig, err
    assert f"stopped by {signal.Signals(sig).name}" in err
    assert not _alive(supervisor) and not _alive(entry)
    assert _worker_folders(tmp) == []


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_a_signal_during_run_ends_the_worker_then_reaches_the_callers_handler(tmp_path):
    class Stopped(Exception):
        pass

    def handler(signum, frame):
        raise Stopped(signum)

    pids = []

    def send_when_running():
        _wait_for(lambda: (tmp_path / "child.pid").exists(), what="the worker's child")
        pids.append(int((tmp_path / "child.pid").read_text()))
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, handler)
    sender = threading.Thread(target=send_when_running, daemon=True)
    try:
        sender.start()
        started = time.monotonic()
        with pytest.raises(Stopped):
            worker.run("builtins:exec", [FORKS.format(d=str(tmp_path), end="import time; time.sleep(60)")],
                       timeout=60)
        assert time.monotonic() - started < 15
        assert signal.getsignal(signal.SIGTERM) is handler  # the caller's handler is back
    finally:
        signal.signal(signal.SIGTERM, previous)
        sender.join(timeout=5)
    grandchild = int((tmp_path / "grandchild.pid").read_text())
    assert not _alive(pids[0]) and not _alive(grandchild)


# ------------------------------------------------------------------------------ optimize --agent

@pytest.fixture
def agent_round(tmp_path, monkeypatch):
    """One agent round on `boundary` with AGENT as the command; the judge is a stub that records it ran."""
    from workbench.agent import loop, scaffold
    from workbench.agent.judge import Verdict
    from workbench.points import Workload

    judged = []
    monkeypatch.setattr(loop, "judge", lambda path, task, work_dir: judged.append(path) or
                        Verdict(False, "gate", "stub judge"))
    workloads = {"sliding": Workload(preset="beam-tiny", dtype="fp32", context=64)}
    shapes = scaffold.shapes_text("boundary", workloads)

    def play(command: str, budget_s: float = 20.0) -> tuple[dict, list]:
        state = loop.PointState("boundary", workloads, {"sliding": 1}, "torch", None, 10.0, 10.0, 1.0)
        agent = loop.AgentLoop(loop.AgentOptions(command, rounds=1, budget_s=budget_s), out_dir=str(tmp_path))
        return agent.round(state, 1, shapes, None), judged
    return play


def _agent(code: str) -> str:
    """`python -c CODE` as an agent command (the task folder is its sys.argv[1])."""
    return f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}"


WRITES_FASTER = f"import sys; sys.path.insert(0, {HERE!r}); import scripted; scripted.write(sys.argv[1], 'faster')\n"

AGENT_FAILURES = {  # agent -> text of the attempt's reason
    "exits_3": (WRITES_FASTER + "print('gave up'); sys.exit(3)", "exited with code 3 (gave up)"),
    "killed": (WRITES_FASTER + "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "died of SIGKILL"),
    "untouched": ("pass", "scaffold it was given (unchanged)"),
    "removes": ("import os, sys; os.remove(os.path.join(sys.argv[1], 'variant.py'))", "no variant.py"),
}


@pytest.mark.parametrize("case", sorted(AGENT_FAILURES))
def test_the_agent_commands_failure_is_the_attempts_outcome(agent_round, case):
    code, text = AGENT_FAILURES[case]
    attempt, judged = agent_round(_agent(code))
    assert attempt["stage"] == "agent" and text in attempt["reason"], attempt["reason"]
    assert not attempt["accepted"] and judged == []
    assert not os.path.exists(os.path.join(attempt["task"], "request.json"))


def test_an_agent_past_its_budget_is_not_judged(agent_round):
    attempt, judged = agent_round(_agent(WRITES_FASTER + "import time; time.sleep(60)"), budget_s=1.0)
    assert attempt["stage"] == "agent" and "budget" in attempt["reason"] and attempt["agent"]["timed_out"]
    assert judged == [] and attempt["agent"]["seconds"] < 10


def test_an_agent_that_exits_0_with_its_own_variant_is_judged_and_leaves_nothing_running(agent_round):
    code = WRITES_FASTER + textwrap.dedent('''
        import os, time
        d = sys.argv[1]
        helper = os.fork()
        if helper == 0:  # a helper left in the group
            time.sleep(60); os._exit(0)
        if os.fork() == 0:  # a daemon that left it
            os.setsid()
            if os.fork() == 0:
                with open(os.path.join(d, "daemon.pid"), "w") as f:
                    f.write(str(os.getpid()))
                time.sleep(60); os._exit(0)
            os._exit(0)
        while not os.path.exists(os.path.join(d, "daemon.pid")):
            time.sleep(0.01)
        with open(os.path.join(d, "helper.pid"), "w") as f:
            f.write(str(helper))
    ''')
    attempt, judged = agent_round(_agent(code))
    assert attempt["stage"] == "gate" and attempt["reason"] == "stub judge" and judged == [attempt["file"]]
    for name in ("helper", "daemon"):
        pid = int(open(os.path.join(attempt["task"], f"{name}.pid")).read())
        assert not _alive(pid), f"the agent's {name} outlived it"
    assert attempt["agent"]["returncode"] == 0


# ------------------------------------------------------------------------------ --worker-timeout, --worker-memory

@pytest.mark.parametrize("command", ["check", "bench", "optimize"])
def test_worker_limit_options_are_documented(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--worker-timeout SECONDS" in text and "--worker-memory GIB" in text and "0: no limit" in text
    with pytest.raises(SystemExit) as bad:
        main([command, *(["boundary"] if command == "bench" else []), "--worker-timeout", "-1"])
    assert bad.value.code == 2


def test_worker_limit_options_reach_the_worker(tmp_path, monkeypatch, capsys):
    seen = []

    def fake_run(entry, args, **kw):
        seen.append(kw)
        return worker.Exit(0, 0.1, None, None, "", True)
    monkeypatch.setattr(worker, "run", fake_run)
    d = str(tmp_path)
    assert main(["check", "boundary:x", "--dir", d, "--worker-timeout", "12", "--worker-memory", "1.5"]) == 0
    assert main(["bench", "boundary", "--dir", d, "--worker-timeout", "0", "--worker-memory", "0"]) == 0
    assert main(["check", "boundary:x", "--dir", d]) == 0
    assert [(k["timeout"], k["mem_bytes"]) for k in seen] == [
        (12.0, int(1.5 * 2**30)), (None, 0), (worker.DEFAULT_TIMEOUT_S, worker.DEFAULT_MEM_BYTES)]

    monkeypatch.setattr(worker, "run", lambda entry, args, **kw: worker.Exit(0, 0.1, None, worker.NO_SENTINEL))
    assert main(["check", "boundary:x", "--dir", d]) == 1
    assert worker.NO_SENTINEL in capsys.readouterr().err


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_sigterm_to_optimize_during_an_agent_run_ends_the_agent_first(agent_round, tmp_path):
    """`workbench optimize` turns SIGTERM into KeyboardInterrupt (its run stops and resumes later); an agent
    command in flight, and the daemon it started, are ended before that reaches the loop."""
    code = textwrap.dedent('''
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            with open(os.path.join(sys.argv[1], "daemon.pid"), "w") as f:
                f.write(str(os.getpid()))
            time.sleep(60); os._exit(0)
        with open(os.path.join(sys.argv[1], "agent.pid"), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)
    ''')
    found = []

    def send_when_running():
        found.extend(_wait_for(lambda: list(tmp_path.glob("agent/boundary/round-1/*.pid"))
                               if len(list(tmp_path.glob("agent/boundary/round-1/*.pid"))) == 2 else None,
                               what="the agent and its daemon"))
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # as `workbench optimize` does
    sender = threading.Thread(target=send_when_running, daemon=True)
    try:
        sender.start()
        with pytest.raises(KeyboardInterrupt):
            agent_round(_agent(code), budget_s=60.0)
    finally:
        signal.signal(signal.SIGTERM, previous)
        sender.join(timeout=5)
    assert len(found) == 2 and not [p.name for p in found if _alive(int(p.read_text()))]
