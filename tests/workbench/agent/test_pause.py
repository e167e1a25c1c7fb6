"""`Pause` stops every process under the judge's worker outside the trusted sandboxes' trees, an orphan
that left its session included, and continues a trusted one the candidate stopped. Run in a process of
its own (the subreaper setting stays there), with counters in shared memory that each process bumps."""

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")

SCRIPT = textwrap.dedent('''
    import mmap, os, signal, struct, sys, time
    from workbench.agent.pause import Pause, adopt_orphans
    from workbench.agent.worker import _descendants

    adopt_orphans()
    counters = mmap.mmap(-1, 16)  # shared with the children forked below: [trusted, orphan]

    def spin(slot):
        while True:
            n = struct.unpack_from("q", counters, 8 * slot)[0]
            struct.pack_into("q", counters, 8 * slot, n + 1)

    def read(slot):
        return struct.unpack_from("q", counters, 8 * slot)[0]

    def moving(slot):
        before = read(slot)
        time.sleep(0.05)
        return read(slot) != before

    trusted = os.fork()
    if trusted == 0:
        spin(0)
    candidate = os.fork()
    if candidate == 0:  # leaves its session and orphans a grandchild, then stops the trusted process
        os.setsid()
        if os.fork() == 0:
            spin(1)
        os.kill(trusted, signal.SIGSTOP)
        os._exit(0)
    os.waitpid(candidate, 0)
    while not read(1):
        time.sleep(0.01)
    pause = Pause([trusted])
    try:
        assert not moving(0) and moving(1)  # stopped by the candidate; the orphan runs
        assert len(pause._untrusted()) == 1, "the orphan did not re-parent here"
        with pause:
            assert not moving(1), "the orphan ran while paused"
            pause.release(trusted)
            assert moving(0), "the trusted process stayed stopped"
        assert moving(1), "the orphan did not resume"
        print("ok")
    finally:
        for pid in _descendants(os.getpid()):
            os.kill(pid, signal.SIGKILL)
''')


def test_pause_stops_orphans_and_releases_the_trusted():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0 and out.strip() == "ok", err
