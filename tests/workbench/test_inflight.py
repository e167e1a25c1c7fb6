"""Candidates that never finish (workbench/inflight.py): a hang, a crash or a stop from outside costs one
run of the search, and a compiler's build is not held against a candidate's limit."""

import json
import os
import shutil

import pytest
from harness_helpers import tiny_runner

from workbench.inflight import stalled_before
from workbench.run_folder import read_json


def _stalled(search, fingerprint):
    """What the last search of boundary left hung, as a search of it now would skip it."""
    path = search.folder.search_result("boundary")
    return stalled_before(read_json(path), fingerprint, "boundary", path)


class _ProcessDied(BaseException):
    """Stands in for the end of a process: escapes the gates' `except Exception`, as os._exit would."""


@pytest.mark.skipif(not os.path.isdir("/proc") or not shutil.which("sleep"), reason="needs Linux /proc and sleep")
def test_a_candidate_s_first_use_build_is_not_held_against_its_limit(tmp_path):
    """A candidate whose first call runs a compiler (here a copy of sleep named nvcc, as FlashInfer's JIT
    runs nvcc) longer than the candidate limit is gated and timed, not ended; the build's time is in
    its result (`compile_s`), apart from the rest."""
    import subprocess

    from workbench import registry
    from workbench.search import Search

    nvcc = tmp_path / "nvcc"
    shutil.copy(shutil.which("sleep"), nvcc)
    reference, built = registry.reference("boundary").fn, []

    def builds_first(*args, **kwargs):
        if not built:
            subprocess.run([str(nvcc), "1.2"], check=True)
            built.append(1)
        return reference(*args, **kwargs)

    stalls = []
    table = registry.variants("boundary")
    table["planted_jit"] = registry.Variant("boundary", "planted_jit", "torch", builds_first)
    try:
        search = Search(tiny_runner(), calls={"boundary": {"sliding": 2, "full": 2}}, out_dir=str(tmp_path),
                        backends=("torch",), candidate_timeout=0.5, on_stall=stalls.append)
        row = search.search_point("boundary").candidate("planted_jit", None)
    finally:
        del table["planted_jit"]
    assert not stalls and row.gate_passed and row.step_us
    assert 0.8 < row.compile_s < row.seconds
    from rich.console import Console

    from workbench.events import CandidateTried
    from workbench.progress import ConsoleProgress

    console = Console(record=True, width=200)
    ConsoleProgress(console).event(CandidateTried("boundary", row))
    assert f"({row.seconds:.1f} s, {row.compile_s:.1f} s of it compiling)" in console.export_text()


def test_a_hung_candidate_costs_one_run_and_is_skipped_when_resumed(tmp_path):
    """The watchdog fires on a candidate that never returns; the candidate stays recorded as in flight,
    so the resumed search skips it with the reason, searches the rest and clears the record."""
    import threading

    from workbench import registry
    from workbench.search import Search

    released, calls_made = threading.Event(), []

    def hangs(*args, **kwargs):
        calls_made.append(1)
        released.wait(60)  # "hung" until the watchdog's stand-in releases it
        raise _ProcessDied

    runner = tiny_runner()
    calls = {"boundary": {"sliding": 2, "full": 2}}
    stalls = []

    def on_stall(candidate):
        stalls.append(candidate)
        released.set()

    table = registry.variants("boundary")
    table["planted_hang"] = registry.Variant("boundary", "planted_hang", "torch", hangs,
                                             configs=[{"unroll": 1}, {"unroll": 2}],
                                             configure=lambda cfg: hangs)
    try:
        first = Search(runner, calls=calls, out_dir=str(tmp_path), backends=("torch",), candidate_timeout=0.5,
                       on_stall=on_stall)
        with pytest.raises(_ProcessDied):
            first.search_point("boundary")
        assert [(c["variant"], c["config"], c["timeout_s"]) for c in stalls] == [("planted_hang", {"unroll": 1}, 0.5)]
        inflight = tmp_path / "search" / "boundary.inflight"
        assert [c["variant"] for c in json.loads(inflight.read_text())["candidates"]] == ["planted_hang"]
        assert not (tmp_path / "search" / "boundary.json").exists()

        n = len(calls_made)
        resumed = Search(runner, calls=calls, out_dir=str(tmp_path), backends=("torch",))
        result = resumed.search_point("boundary")
        assert len(calls_made) == n  # never called again
        rows = [c for c in result.candidates if c.variant == "planted_hang"]
        assert [r.config for r in rows] == [{"unroll": 1}, {"unroll": 2}]  # neither config is tried
        assert all("did not finish in an earlier run" in r.skipped and "boundary.inflight" in r.skipped
                   and "{'unroll': 1}" in r.skipped for r in rows)
        assert result.choice == "torch" and not inflight.exists()
        assert (tmp_path / "search" / "boundary.json").exists()

        # A variant added to the point makes its cache stale: the point is searched again, and the
        # hung variant, whose code did not change, is skipped again rather than hung on again.
        table["planted_new"] = registry.Variant("boundary", "planted_new", "torch", registry.reference("boundary").fn)
        again = Search(runner, calls=calls, out_dir=str(tmp_path), backends=("torch",)).search_point("boundary")
        assert len(calls_made) == n and "planted_new" in [c.variant for c in again.candidates]
        rows = [c for c in again.candidates if c.variant == "planted_hang"]
        assert rows and all("did not finish in an earlier run" in r.skipped and "its code is unchanged" in r.skipped
                            for r in rows)
        # Its code changed (here: the saved record says it was other code): it is tried again.
        fresh = Search(runner, calls=calls, out_dir=str(tmp_path), backends=("torch",))
        fingerprint = fresh.fingerprint("boundary")
        cache = tmp_path / "search" / "boundary.json"
        saved = json.loads(cache.read_text())
        assert set(_stalled(fresh, fingerprint)) == {"planted_hang"}
        other_source = {**saved["fingerprint"], "sources": {**saved["fingerprint"]["sources"], "planted_hang": "x"}}
        # its module changed outside its code and configs (another variant's config list): still skipped
        cache.write_text(json.dumps({**saved, "fingerprint": other_source}))
        assert set(_stalled(fresh, fingerprint)) == {"planted_hang"}
        cache.write_text(json.dumps({**saved, "fingerprint": other_source,
                                     "code_keys": {**saved["code_keys"], "planted_hang": "other code"}}))
        assert _stalled(fresh, fingerprint) == {}
        cache.write_text(json.dumps({**{k: v for k, v in saved.items() if k != "code_keys"},
                                     "fingerprint": other_source}))  # saved before code keys existed
        assert _stalled(fresh, fingerprint) == {}
        cache.write_text(json.dumps({**saved, "fingerprint": {**saved["fingerprint"], "calls": {"sliding": 9}}}))
        assert _stalled(fresh, fingerprint) == {}  # other shapes: nothing carried over
        cache.write_text(json.dumps({**saved, "fingerprint": {**saved["fingerprint"], "workloads": {"all": "other"}}}))
        assert _stalled(fresh, fingerprint) == {}
    finally:
        table.pop("planted_new", None)
        del table["planted_hang"]
        released.set()


def test_a_candidate_stopped_from_outside_is_tried_again_once(tmp_path):
    """Ctrl-C, or a command's time limit (SIGTERM, which the CLI turns into the same), stopping a run
    in a candidate (a FlashInfer JIT build cut off by a time limit) is not the candidate's hang:
    the next run tries it again; one stopped in STOPS_TRIED runs is then skipped like a hung one."""
    from workbench import registry
    from workbench.inflight import STALLED, STOPS_TRIED
    from workbench.search import Search

    stop, calls_made = [True], []
    reference = registry.reference("boundary").fn

    def stopped_in(*args, **kwargs):
        calls_made.append(1)
        if stop[0]:
            raise KeyboardInterrupt
        return reference(*args, **kwargs)

    runner = tiny_runner()
    calls = {"boundary": {"sliding": 2, "full": 2}}
    table = registry.variants("boundary")
    table["planted_stop"] = registry.Variant("boundary", "planted_stop", "torch", stopped_in)
    inflight = tmp_path / "search" / "boundary.inflight"

    def search():
        return Search(runner, calls=calls, out_dir=str(tmp_path), backends=("torch",)).search_point("boundary")
    try:
        for n in range(1, STOPS_TRIED + 1):  # stopped in it run after run: each run tries it again
            with pytest.raises(KeyboardInterrupt):
                search()
            assert [(c["variant"], c["stopped"]) for c in json.loads(inflight.read_text())["candidates"]] == \
                [("planted_stop", n)]
        tried = len(calls_made)
        stop[0] = False
        row = next(c for c in search().candidates if c.variant == "planted_stop")
        assert len(calls_made) == tried and STALLED in row.skipped  # stopped too often: skipped
        (tmp_path / "search" / "boundary.json").unlink()
        inflight.write_text(json.dumps({"fingerprint": json.loads(json.dumps(Search(
            runner, calls=calls, out_dir=str(tmp_path), backends=("torch",)).fingerprint("boundary"))),
            "candidates": [{"point": "boundary", "variant": "planted_stop", "config": None, "stopped": 1}]}))
        row = next(c for c in search().candidates if c.variant == "planted_stop")
        assert len(calls_made) > tried and row.skipped is None and row.gate_passed and not inflight.exists()
    finally:
        del table["planted_stop"]
