"""Candidate code runs here, in a child process with a time limit and a memory limit.

Parent side: `run(entry, args, ...)` starts `python -m workbench.agent.worker MODULE:FUNCTION ARGS`
in its own process group, kills the group at the time limit or when its resident memory passes the
limit, and returns an `Exit` that says what happened (exit code, the signal that killed it, time,
the log's tail). A crash, hang, CUDA error or illegal memory access in the candidate ends the
child, never the workbench. Child side: `main` limits memory, then calls FUNCTION(*ARGS) of MODULE
and exits with its return value. The caller names the entry point (`judge.worker_main` gates and
times a candidate; `commands.common.command_in_worker` runs a CLI command with plugin directories
loaded), so this module imports none of its callers.
The child limits its own address space (RLIMIT_AS) on CPU runs; CUDA reserves far more address
space than it uses, so on the GPU the parent's resident-memory watch is the limit.
"""

from __future__ import annotations

import collections
import importlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass

INSIDE = "BEAM_WORKBENCH_WORKER"          # set in the child: plugin code may be imported here
MEM_ENV = "BEAM_WORKBENCH_WORKER_MEM"     # bytes; the child's RLIMIT_AS on CPU runs
DEFAULT_TIMEOUT_S = 1800.0
DEFAULT_MEM_BYTES = 16 << 30


@dataclass
class Exit:
    returncode: int | None
    seconds: float
    killed: str | None = None   # "timeout" or "memory": the parent ended it
    reason: str | None = None   # None when the child exited 0
    tail: str = ""

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


def run(entry: str, args: list[str], *, timeout: float = DEFAULT_TIMEOUT_S, mem_bytes: int = DEFAULT_MEM_BYTES,
        device: str = "cpu", log_path: str | None = None, forward: bool = False) -> Exit:
    """Run `entry` ("module:function") on the string `args` in an isolated worker. Output goes to
    `log_path`, or with `forward` to this process's stdout/stderr as it comes."""
    if entry.count(":") != 1:
        raise ValueError(f"a worker entry point is 'module:function', not {entry!r}")
    env = {**os.environ, INSIDE: "1", MEM_ENV: str(mem_bytes) if device.split(":")[0] == "cpu" else ""}
    cmd = [sys.executable, "-m", "workbench.agent.worker", entry, *args]
    tail: collections.deque[str] = collections.deque(maxlen=40)
    log = open(log_path, "w") if log_path else None
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT if log else subprocess.PIPE,
                            text=True)
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
    killed = None
    while proc.poll() is None:
        if time.monotonic() - started > timeout:
            killed = "timeout"
        elif mem_bytes and _rss_bytes(proc.pid) > mem_bytes:
            killed = "memory"
        if killed:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the child's own group: it and anything it started
            except ProcessLookupError:
                pass
            proc.wait()
            break
        time.sleep(0.05)
    for t in pumps:
        t.join(timeout=5)
    seconds = time.monotonic() - started
    if log:
        log.close()
        with open(log_path, errors="replace") as f:
            tail.extend(f.read()[-4000:].splitlines(keepends=True))
    text = "".join(tail)[-2000:]
    code = proc.returncode
    if killed == "timeout":
        reason = f"timed out after {timeout:.0f} s (killed)"
    elif killed == "memory":
        reason = f"used more than {mem_bytes / 2**30:.1f} GiB of memory (killed)"
    elif code is not None and code < 0:
        reason = f"the worker died of {_signal_name(code)} (a crash in the candidate: segfault, abort, " \
                 "illegal memory access)"
    elif code:
        last = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "")
        reason = f"the worker exited with code {code}" + (f": {last}" if last else "")
    else:
        reason = None
    return Exit(code, round(seconds, 2), killed, reason, text)


# ------------------------------------------------------------------------------------------- child

def _limit_memory() -> None:
    limit = os.environ.get(MEM_ENV)
    if limit:
        import resource

        n = int(limit)
        resource.setrlimit(resource.RLIMIT_AS, (n, n))


def main(argv: list[str]) -> int:
    """`MODULE:FUNCTION ARG...`: FUNCTION(*ARGs) of MODULE, after the memory limit; its return value
    is the exit code."""
    if not argv or argv[0].count(":") != 1:
        print("usage: python -m workbench.agent.worker MODULE:FUNCTION [ARG...]", file=sys.stderr)
        return 2
    _limit_memory()
    module, function = argv[0].split(":")
    return getattr(importlib.import_module(module), function)(*argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
