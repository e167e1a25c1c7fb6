"""Candidate code runs here, in a child process with a time limit and a memory limit.

Parent side: `run(entry, args, ...)` starts `python -m workbench.agent.worker MODULE:FUNCTION ARGS`
in its own process group, ends it at the time limit or when its resident memory passes the limit,
and returns an `Exit` that says what happened (exit code, the signal that killed it, time, the log's
tail). A crash, hang, CUDA error or illegal memory access in the candidate ends the child, never the
workbench. The caller names the entry point (`judge.worker_main` gates and times a candidate;
`commands.common.command_in_worker` runs a CLI command with plugin directories loaded), so this
module imports none of its callers.

Nothing the worker starts outlives it (Linux; elsewhere the process group is the limit):
- The child is a supervisor that runs no candidate code: a subreaper (PR_SET_CHILD_SUBREAPER) that
  forks the entry's process (before torch is imported, so no second interpreter starts). Whatever
  the entry's process started, even a grandchild that left the group with setsid, re-parents to the
  supervisor once its own parent is gone; when the entry's process ends, however it ends (a return,
  os._exit, a crash, the parent's kill), the supervisor gives what is left GRACE_S to end by itself,
  kills the rest, reaps it, and exits as the entry did (its exit code, or the signal it died of).
  A supervisor can die first only if something kills it from outside.
- Parent-death signals (PR_SET_PDEATHSIG): the entry's process gets SIGKILL when the supervisor dies;
  the supervisor gets SIGTERM when the workbench dies (even of SIGKILL), and ends the whole tree.
- After every exit the parent kills the process group, then any process that still carries this
  run's mark (RUN_ENV, inherited through the environment): a supervisor killed from outside leaves
  no orphan either, unless one also dropped its environment.
- The parent holds SIGTERM and SIGINT off while a worker runs (`hold_signals`): on one it ends the
  worker as above, and then hands the signal to the handler that was there before (the process's
  own, e.g. KeyboardInterrupt), so a Ctrl-C or a time limit never leaves a worker behind.

Completion sentinel: the parent sends a random token through a pipe the child reads at start-up
(never in its environment or arguments); the entry's process writes it back through another pipe
only once FUNCTION has returned. An exit without it (`sys.exit(0)` or `os._exit(0)` in candidate
code, an entry that raised SystemExit) is a failure: NO_SENTINEL, never a success.
The entry's process limits its own address space (RLIMIT_AS) on CPU runs; CUDA reserves far more
address space than it uses, so on the GPU the parent's resident-memory watch is the limit.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass

INSIDE = "BEAM_WORKBENCH_WORKER"          # set in the child: plugin code may be imported here
MEM_ENV = "BEAM_WORKBENCH_WORKER_MEM"     # bytes; the child's RLIMIT_AS on CPU runs
FDS_ENV = "BEAM_WORKBENCH_WORKER_FDS"     # "TOKEN_FD,DONE_FD": the sentinel's pipes (removed at start)
PARENT_ENV = "BEAM_WORKBENCH_WORKER_PARENT"  # the parent's pid: a worker whose parent is gone stops
RUN_ENV = "BEAM_WORKBENCH_RUN_MARK"       # random per run; everything the run starts inherits it
DEFAULT_TIMEOUT_S = 1800.0
DEFAULT_MEM_BYTES = 16 << 30
GRACE_S = 0.5          # after the entry's process ended, how long what it started may take to end itself
STOP_WAIT_S = 5.0      # how long the parent waits for a stopped supervisor before killing the group
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
NO_SENTINEL = "the worker exited without finishing (no completion sentinel)"
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36


@dataclass
class Exit:
    returncode: int | None
    seconds: float
    killed: str | None = None   # "timeout", "memory" or "signal" (this process was stopped): the parent ended it
    reason: str | None = None   # None only when the entry returned 0 and its sentinel came back
    tail: str = ""
    finished: bool = False      # the entry returned (its completion sentinel came back)

    def to_dict(self) -> dict:
        return asdict(self)


def inside_worker() -> bool:
    return os.environ.get(INSIDE) == "1"


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _prctl(option: int, value: int) -> bool:
    """prctl(2) on Linux; False (nothing done) elsewhere or when it fails."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(option, ctypes.c_ulong(value), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _children(pid: int) -> list[int]:
    """The live children of `pid` (Linux /proc; [] elsewhere)."""
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(p) for p in f.read().split()]
        except (OSError, ValueError):
            pass
    return out


def _descendants(pid: int) -> list[int]:
    found, todo = [], _children(pid)
    while todo:
        p = todo.pop()
        if p not in found:
            found.append(p)
            todo += _children(p)
    return found


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ------------------------------------------------------------------------------------------ parent

class Held:
    """SIGTERM and SIGINT held off by `hold_signals`: `signum` is the first that arrived, or None."""

    def __init__(self):
        self.signum: int | None = None
        self.taken = False

    def take(self) -> int | None:
        """The held signal, now the caller's to act on (then it is not delivered at the hold's end)."""
        self.taken = self.signum is not None
        return self.signum


_held: Held | None = None  # the outermost hold in force


@contextlib.contextmanager
def hold_signals():
    """While the body runs, SIGTERM and SIGINT (those this process does not ignore) are only recorded
    (`Held.signum`), so the body can end its worker and clean up; at the end the first one goes to the
    handler that was there before (KeyboardInterrupt for SIGINT; by default SIGTERM ends the process)
    unless the body `take()`s it. Nested holds share the outermost; only the main thread can hold."""
    global _held
    if _held is not None:
        yield _held
        return
    held = Held()
    if threading.current_thread() is not threading.main_thread():
        yield held
        return

    def record(signum, frame):
        if held.signum is None:
            held.signum = signum

    previous = {}
    for s in STOP_SIGNALS:
        handler = signal.getsignal(s)
        if handler is not None and handler is not signal.SIG_IGN:
            previous[s] = signal.signal(s, record)
    _held = held
    try:
        yield held
    finally:
        _held = None
        for s, handler in previous.items():
            signal.signal(s, handler)
        if held.signum is not None and not held.taken:
            signal.raise_signal(held.signum)


def exited(proc: subprocess.Popen) -> bool:
    """Whether `proc` has ended, without reaping it: while it is a zombie its pid, the id of its
    process group, cannot be given to another process, so killing that group is safe."""
    if proc.returncode is not None:
        return True
    waitid = getattr(os, "waitid", None)
    if waitid is None:
        return proc.poll() is not None
    try:
        return waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return proc.poll() is not None


def kill_marked(mark: str) -> int:
    """SIGKILL every process (of this user) whose environment carries RUN_ENV=`mark`; how many."""
    needle, killed = f"{RUN_ENV}={mark}".encode(), 0
    for _ in range(10):  # one may fork while it is being found
        try:
            pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
        except OSError:
            return killed
        found = 0
        for pid in pids:
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    marked = needle in f.read().split(b"\0")
            except OSError:
                continue
            if marked and pid != os.getpid():
                _kill(pid)
                found += 1
        if not found:
            break
        killed += found
        time.sleep(0.01)
    return killed


def end_group(proc: subprocess.Popen, mark: str | None = None) -> None:
    """After `proc` (started with start_new_session) ended, or to end it: SIGKILL its process group,
    reap it, then kill what still carries `mark` (processes that left the group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    if mark:
        kill_marked(mark)


def _stop(proc: subprocess.Popen) -> None:
    """Ask the supervisor to end its tree (SIGCONT first: it may have been stopped), and wait for it."""
    for sig in (signal.SIGCONT, signal.SIGTERM):
        _kill(proc.pid, sig)
    deadline = time.monotonic() + STOP_WAIT_S
    while not exited(proc) and time.monotonic() < deadline:
        time.sleep(0.01)


def _sentinel(fd: int) -> bytes:
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 256)
    except (BlockingIOError, OSError):
        return b""
    finally:
        os.close(fd)


def run(entry: str, args: list[str], *, timeout: float | None = DEFAULT_TIMEOUT_S,
        mem_bytes: int | None = DEFAULT_MEM_BYTES, device: str = "cpu", log_path: str | None = None,
        forward: bool = False) -> Exit:
    """Run `entry` ("module:function") on the string `args` in an isolated worker. Output goes to
    `log_path`, or with `forward` to this process's stdout/stderr as it comes. `timeout` (seconds) and
    `mem_bytes`: 0 or None is no limit. A SIGTERM or SIGINT meanwhile ends the worker (`killed`
    "signal") and then reaches this process's own handler (see `hold_signals`)."""
    if entry.count(":") != 1:
        raise ValueError(f"a worker entry point is 'module:function', not {entry!r}")
    with hold_signals() as held:
        return _run(entry, args, held, timeout=timeout or None, mem_bytes=mem_bytes or 0, device=device,
                    log_path=log_path, forward=forward)


def _run(entry, args, held: Held, *, timeout, mem_bytes, device, log_path, forward) -> Exit:
    if held.signum is not None:
        return Exit(None, 0.0, "signal", f"stopped by {_signal_name(-held.signum)} before the worker started")
    token, mark = secrets.token_hex(16).encode(), secrets.token_hex(8)
    token_r, token_w = os.pipe()
    os.write(token_w, token)  # waits in the pipe for the child
    os.close(token_w)
    done_r, done_w = os.pipe()
    cpu = device.split(":")[0] == "cpu"
    env = {**os.environ, INSIDE: "1", MEM_ENV: str(mem_bytes) if mem_bytes and cpu else "",
           FDS_ENV: f"{token_r},{done_w}", PARENT_ENV: str(os.getpid()), RUN_ENV: mark}
    cmd = [sys.executable, "-m", "workbench.agent.worker", entry, *args]
    tail: collections.deque[str] = collections.deque(maxlen=40)
    log = open(log_path, "w") if log_path else None
    started = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                                stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT if log else subprocess.PIPE,
                                text=True, pass_fds=(token_r, done_w))
    except BaseException:
        os.close(done_r)
        if log:
            log.close()
        raise
    finally:
        os.close(token_r)
        os.close(done_w)
    pumps = []
    if not log:
        def pump(src, dst, keep):
            for line in src:
                if keep:
                    tail.append(line)
                if forward:
                    dst.write(line)
                    dst.flush()
        pumps = [threading.Thread(target=pump, args=(proc.stdout, sys.stdout, False), daemon=True),
                 threading.Thread(target=pump, args=(proc.stderr, sys.stderr, True), daemon=True)]
        for t in pumps:
            t.start()
    killed, watched = None, None
    try:
        while not exited(proc):
            if held.signum is not None:
                killed = "signal"
            elif timeout and time.monotonic() - started > timeout:
                killed = "timeout"
            elif mem_bytes:
                watched = watched or next(iter(_children(proc.pid)), None)  # the entry's process
                if _rss_bytes(watched or proc.pid) > mem_bytes:
                    killed = "memory"
            if killed:
                break
            time.sleep(0.05)
    finally:  # every exit, and an exception here too: nothing the worker started is left running
        if not exited(proc):
            _stop(proc)
        end_group(proc, mark)
        finished = _sentinel(done_r) == token
        for t in pumps:
            t.join(timeout=5)
        if log:
            log.close()
    seconds = time.monotonic() - started
    if log:
        with open(log_path, errors="replace") as f:
            tail.extend(f.read()[-4000:].splitlines(keepends=True))
    text = "".join(tail)[-2000:]
    code = proc.returncode
    if killed == "timeout":
        reason = f"timed out after {timeout:.0f} s (killed)"
    elif killed == "memory":
        reason = f"used more than {mem_bytes / 2**30:.1f} GiB of memory (killed)"
    elif killed == "signal":
        reason = f"stopped by {_signal_name(-held.signum)} (the worker was ended)"
    elif code is not None and code < 0:
        reason = f"the worker died of {_signal_name(code)} (a crash in the candidate: segfault, abort, " \
                 "illegal memory access)"
    elif code:
        last = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "")
        reason = f"the worker exited with code {code}" + (f": {last}" if last else "")
    elif not finished:
        reason = NO_SENTINEL
    else:
        reason = None
    return Exit(code, round(seconds, 2), killed, reason, text, finished and not killed)


# ------------------------------------------------------------------------------------------- child

def _limit_memory() -> None:
    limit = os.environ.get(MEM_ENV)
    if limit:
        import resource

        n = int(limit)
        resource.setrlimit(resource.RLIMIT_AS, (n, n))


def _take_sentinel() -> tuple[bytes | None, int | None]:
    """The token the parent sent and the fd to write it back to; (None, None) when run by hand."""
    fds = os.environ.pop(FDS_ENV, "")
    if not fds:
        return None, None
    token_fd, done_fd = (int(x) for x in fds.split(","))
    chunks = []
    while chunk := os.read(token_fd, 256):
        chunks.append(chunk)
    os.close(token_fd)
    os.set_inheritable(done_fd, False)  # what the entry starts does not get it
    return b"".join(chunks), done_fd


def _reap() -> bool:
    """Reap every child that has ended; True while any child is left."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


def _end_tree(grace: float) -> None:
    """The supervisor's sweep: `grace` seconds for its children to end (they re-parent here as their
    parents die: it is a subreaper), then SIGKILL to every descendant until none is left."""
    deadline = time.monotonic() + grace
    while _reap() and time.monotonic() < deadline:
        time.sleep(0.01)
    deadline = time.monotonic() + 10.0
    while _reap() and time.monotonic() < deadline:
        for pid in _descendants(os.getpid()):
            _kill(pid)
        time.sleep(0.005)


def _die_of(sig: int):
    """End this process as the entry's ended: of the same signal (no core file: the entry wrote its own)."""
    import resource

    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    except (ValueError, OSError):
        pass
    with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler to reset
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)  # a signal whose default is not to end a process


def _supervise(pid: int):
    """The supervisor: wait for the entry's process `pid`, end what it left, exit as it did. A SIGTERM
    (the parent stopping the worker, or the parent's death) ends the whole tree at once."""
    reaped = []

    def stop(signum, frame):
        if not reaped:
            _kill(pid)
        _end_tree(0.0)
        _die_of(signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
    except ChildProcessError:
        code = 1
    reaped.append(pid)
    _end_tree(GRACE_S)
    if code < 0:
        _die_of(-code)
    os._exit(code)


def main(argv: list[str]) -> int:
    """`MODULE:FUNCTION ARG...`: FUNCTION(*ARGs) of MODULE, after the memory limit, in a process the
    supervisor forked; its return value is the exit code."""
    if not argv or argv[0].count(":") != 1:
        print("usage: python -m workbench.agent.worker MODULE:FUNCTION [ARG...]", file=sys.stderr)
        return 2
    token, done_fd = _take_sentinel()
    parent = os.environ.pop(PARENT_ENV, "")
    if hasattr(os, "fork"):
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if parent and os.getppid() != int(parent):
            return 1  # the parent died before the death signal was set
        supervisor = os.getpid()
        pid = os.fork()
        if pid:
            if done_fd is not None:
                os.close(done_fd)
            _supervise(pid)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != supervisor:
            os._exit(1)
    _limit_memory()
    module, function = argv[0].split(":")
    code = getattr(importlib.import_module(module), function)(*argv[1:]) or 0
    if done_fd is not None:  # FUNCTION returned: the sentinel goes back
        os.write(done_fd, token)
        os.close(done_fd)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
