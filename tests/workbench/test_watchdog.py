"""The search's watchdog (`workbench/watchdog.py`): time while a compiler the process started runs is not
held against a candidate's limit (a FlashInfer JIT build ran a prefill candidate past it), a stuck
candidate is still caught, and so is a compiler that never ends. The compilers here are copies of
`sleep` named as compilers, so /proc shows them under those names."""

import os
import shutil
import subprocess
import threading
import time

import pytest

from workbench import watchdog

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc") or not shutil.which("sleep"),
                                reason="needs Linux /proc and sleep")


@pytest.fixture
def compiler(tmp_path):
    """compiler(name, seconds): a started process called `name` that runs `seconds`, a child of this one."""
    started = []

    def start(name, seconds, via_shell=False):
        exe = tmp_path / name
        shutil.copy(shutil.which("sleep"), exe)
        # "; true" keeps the shell from exec'ing the compiler: it stays a grandchild
        argv = ["sh", "-c", f"'{exe}' {seconds}; true"] if via_shell else [str(exe), str(seconds)]
        started.append(subprocess.Popen(argv))
        deadline = time.monotonic() + 5
        while watchdog.running_compiler() != name and time.monotonic() < deadline:
            time.sleep(0.01)  # until the process shows under its name
        return started[-1]

    yield start
    for p in started:
        p.kill()
        p.wait()


def test_a_compiler_child_or_grandchild_is_found_and_another_process_s_is_not(compiler):
    assert watchdog.running_compiler() is None
    p = compiler("nvcc", 30)
    assert watchdog.running_compiler() == "nvcc"
    other = subprocess.Popen([shutil.which("sleep"), "30"])
    try:
        assert watchdog.running_compiler(root=other.pid) is None  # nvcc is not that process's child
    finally:
        other.kill()
        other.wait()
    p.kill()
    p.wait()
    assert watchdog.running_compiler() is None
    compiler("ptxas", 30, via_shell=True)
    assert watchdog.running_compiler() == "ptxas"


def _watch(limit_s, **kw):
    stalls, fired = [], threading.Event()

    def on_stall(candidate):
        stalls.append(candidate)
        fired.set()

    dog = watchdog.Watchdog(limit_s, on_stall, {"variant": "v"}, tick_s=0.02, **kw).start()
    return dog, stalls, fired


def test_a_compile_is_not_held_against_the_limit(compiler):
    dog, stalls, fired = _watch(0.3)
    compiler("ninja", 0.8).wait()  # a build past the limit, while nothing else runs
    assert not stalls
    assert fired.wait(5)  # idle after the build: the limit runs again
    assert 0.5 < stalls[0]["compile_s"] < 5 and dog.stop() >= 0.5


def test_a_stuck_candidate_is_caught_without_a_compiler():
    started = time.monotonic()  # before the watch starts: its limit counts from its own start
    dog, stalls, fired = _watch(0.2)
    assert fired.wait(5) and time.monotonic() - started >= 0.2
    assert stalls == [{"variant": "v", "compile_s": 0.0}]


def test_a_compiler_that_never_ends_is_caught(compiler):
    dog, stalls, fired = _watch(30, compile_limit_s=0.3)
    compiler("cicc", 30)
    assert fired.wait(5) and stalls[0]["compile_s"] >= 0.3


def test_stopped_in_time_it_never_fires():
    dog, stalls, fired = _watch(0.2)
    assert dog.stop() == 0.0
    assert not fired.wait(0.4) and not stalls
