"""The terminal UI driven headless with textual's Pilot on beam-tiny (CPU): a real search started
from the Search view (one point skipped) whose candidates arrive live, the profile view of it and
of the run folder it wrote, the lock it wrote opened and verified in the Lock view, pause, close
and resume, a broken lock file, the help screen. Then the committed decode-b1 run opened as
`workbench tui --run` opens it: its search results and the device it was measured on, and a copy
with broken or missing files, each named with its problem in its view."""

import argparse
import asyncio
import glob
import json
import os
import shutil
import threading
import time

import pytest
from harness_helpers import POINTS_SEARCHED, made_once, tiny_options
from textual.widgets import DataTable, Static

from workbench.commands.tui import add_arguments
from workbench.commands.tui import options as tui_options
from workbench.events import PointStarted, StageStarted
from workbench.lock import Lock
from workbench.registry import DRAFTER_POINTS, POINTS, variants
from workbench.tui import WorkbenchApp
from workbench.tui.help import HelpScreen
from workbench.tui.session import SearchSession, SessionClosed

SKIPPED = "qkvg_proj"
SIZE = (160, 48)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DECODE_RUN = os.path.join(ROOT, "runs", "optimize-decode-b1-beam-501b-tp8")


def options(out, points=POINTS_SEARCHED):
    return tiny_options(out, points=points, command="pytest tui")


def rows(app, selector):
    table = app.screen.query_one(selector, DataTable)
    return [[str(cell) for cell in table.get_row_at(i)] for i in range(table.row_count)]


def text(app, selector):
    return str(app.screen.query_one(selector, Static).render())


async def wait_for(pilot, condition, timeout, what):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)  # not pilot.pause: no forced repaints competing with the run for the CPU
    await pilot.pause()


def _drive_a_search(tmp_path_factory) -> dict:
    """One search run through the app, as a person would drive it: Search view, g, skip a point,
    watch the candidates arrive, then the Profile and Lock views of the result (v verifies)."""
    out = str(tmp_path_factory.mktemp("tui"))
    seen = {"out": out}

    async def drive():
        app = WorkbenchApp(options(out))
        async with app.run_test(size=SIZE) as pilot:
            # Started paused (p before g: it waits before its first candidate), so the skip lands
            # before the skipped point could try one, whichever point the ranking puts first.
            await pilot.press("2", "p", "g")
            assert app.searching
            points = [r[0] for r in rows(app, "#search-points")]
            await pilot.press(*["down"] * points.index(SKIPPED), "s")
            seen["skip_state"] = dict((r[0], r[1]) for r in rows(app, "#search-points"))[SKIPPED]
            await pilot.press("p")
            await wait_for(pilot, lambda: rows(app, "#search-candidates"), 120, "a candidate")
            seen["candidates_while_running"] = len(rows(app, "#search-candidates")) if app.searching else 0
            seen["incumbents_while_running"] = text(app, "#search-estimate")
            await wait_for(pilot, lambda: not app.searching, 180, "the search to finish")
            await pilot.pause()
            seen["status"] = text(app, "#search-status")
            seen["points"] = rows(app, "#search-points")
            seen["candidates"] = rows(app, "#search-candidates")
            seen["estimate"] = text(app, "#search-estimate")
            await pilot.press("1")
            seen["profile_rows"] = rows(app, "#profile-points")
            await pilot.press("3", "v")
            seen["lock_summary"] = text(app, "#lock-summary")
            seen["lock_rows"] = rows(app, "#lock-entries")
            await wait_for(pilot, lambda: not app.lock_view.verdict.startswith("verifying"), 120, "verify")
            seen["verdict"] = app.lock_view.verdict

    with pytest.MonkeyPatch.context() as mp:
        # As in tests/workbench/conftest.py: interpreted Triton kernels are for correctness, not for timing.
        mp.delenv("TRITON_INTERPRET", raising=False)
        asyncio.run(drive())
    return seen


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """`_drive_a_search`'s record of the app, made once for all the session's workers (`made_once`)."""
    return made_once(tmp_path_factory, "tui_session", lambda: _drive_a_search(tmp_path_factory))


def test_candidates_arrive_while_the_search_runs(session):
    assert session["candidates_while_running"] >= 1
    assert session["status"].startswith("done: 2/2 points"), session["status"]
    by_variant = {r[1].rstrip(" *"): r for r in session["candidates"]}
    assert set(by_variant) == set(variants("boundary")) - {"torch"}
    compiled = by_variant["torch_compile"]
    assert compiled[2] == "pass" and float(compiled[3]) > 0 and compiled[5].startswith("x")
    assert by_variant["triton"][2].startswith("skipped:")  # no GPU and no interpreter here
    states = {r[0]: r[1] for r in session["points"]}
    assert states == {"boundary": "done", SKIPPED: "skipped"}
    assert session["incumbents_while_running"].startswith("incumbents: ")
    assert "estimated step" in session["incumbents_while_running"]
    locked = {r[0]: r[1] for r in session["lock_rows"] if r[1] != "torch"}
    assert session["estimate"].startswith(f"locked: {', '.join(f'{p}={v}' for p, v in locked.items()) or 'reference'}")


def test_a_skipped_point_is_not_searched_nor_cached(session):
    assert session["skip_state"] == "skip asked"
    assert all(r[0] == "boundary" for r in session["candidates"]), session["candidates"]
    search = os.path.join(session["out"], "search")
    assert os.path.isfile(os.path.join(search, "boundary.json"))
    assert not os.path.exists(os.path.join(search, f"{SKIPPED}.json"))  # a later run searches it


def test_live_profile_view_lists_every_point_by_cost(session):
    table = session["profile_rows"]
    assert {r[0] for r in table} == set(POINTS) - set(DRAFTER_POINTS)  # a decode step runs no drafter
    times = [float(r[1]) for r in table]
    assert times == sorted(times, reverse=True) and times[0] > 0
    bars = [r[3] for r in table[:3]]  # a bar per costly row, longest first
    assert all(b.strip() and not b.strip("█▏▎▍▌▋▊▉ ") for b in bars) and len(bars[0]) >= len(bars[2])


def test_lock_view_opens_the_lock_the_search_wrote_and_verifies_it(session):
    assert session["lock_summary"].startswith(os.path.join(session["out"], "lock.yaml"))
    assert "target decode-b1, model beam-tiny" in session["lock_summary"]
    assert {r[0] for r in session["lock_rows"]} == set(POINTS)
    assert dict((r[0], r[1]) for r in session["lock_rows"])[SKIPPED] == "torch"
    assert session["verdict"].startswith("verify OK"), session["verdict"]


def test_profile_view_of_a_run_folder_and_a_selected_point(session):
    async def drive():
        app = WorkbenchApp(options(session["out"]), run_dir=session["out"])
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            assert "decode-b1 on beam-tiny" in text(app, "#profile-summary")
            names = [r[0] for r in rows(app, "#profile-points")]
            assert set(names) == set(POINTS) - set(DRAFTER_POINTS)
            await pilot.press(*["down"] * names.index("boundary"))
            assert text(app, "#point-title").startswith("boundary:")
            assert "search chose" in text(app, "#point-title")
            found = {r[0].rstrip(" *"): r for r in rows(app, "#point-variants")}
            assert set(found) == set(variants("boundary"))
            assert found["torch"][2] == "reference" and found["torch_compile"][2] == "pass"
            assert rows(app, "#point-kernels") and all(r[0].startswith("aten::") for r in rows(app, "#point-kernels"))
            await pilot.press("enter")
            assert app.focused.id == "point-variants"
            await pilot.press("escape")
            assert app.focused.id == "profile-points"
            await pilot.press("down")  # the next point's details follow the cursor
            assert text(app, "#point-title").startswith(names[names.index("boundary") + 1] + ":")
            assert app.query_one("#lock-entries", DataTable).row_count == len(POINTS)

    asyncio.run(drive())


def test_a_paused_search_waits_and_closing_it_leaves_nothing_half_written(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = str(tmp_path)

    async def drive():
        app = WorkbenchApp(options(out, points=("boundary",)), start_search=True)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("p")  # before the search exists: applied the moment it is announced
            await wait_for(pilot, lambda: app.search_view.state.get("boundary") != "queued", 60, "the point to start")
            await pilot.pause(1.0)
            assert app.search_view.state["boundary"] == "gating & timing"
            assert rows(app, "#search-candidates") == []  # paused before its first candidate
            assert "paused" in text(app, "#search-status")
            await pilot.press("q")  # closing releases the paused search, which stops at its next event
        return app

    app = asyncio.run(drive())
    assert app.search_worker.is_finished and app.search_worker.result is None
    assert not os.path.exists(os.path.join(out, "lock.yaml"))
    assert not os.path.exists(os.path.join(out, "search", "boundary.json"))  # stopped mid-point: not cached


def test_session_applies_pause_and_skip_asked_before_the_search_exists():
    class FakeSearch:  # what SearchSession touches of workbench.search.Search
        def __init__(self):
            self.skip, self.resume = set(), threading.Event()
            self.resume.set()

    posted = []
    session = SearchSession(options("unused"), posted.append)
    session.pause(True)
    session.skip("route")
    search = FakeSearch()
    session._event(StageStarted("search", order=["route"], search=search))
    assert search.skip == {"route"} and not search.resume.is_set()
    session.pause(False)
    assert search.resume.is_set()
    session.skip("head")
    assert search.skip == {"route", "head"}
    session.pause(True)
    session.close()
    assert search.resume.is_set()  # a paused search is released so that it can stop
    with pytest.raises(SessionClosed):
        session._event(PointStarted("route"))
    assert [m.event["type"] for m in posted] == ["stage"]


def test_search_view_notes_the_end_to_end_stage():
    """The search view's line under the table follows the end-to-end stage's events (no app needed:
    `handle` only sets state and redraws)."""
    from types import SimpleNamespace

    from workbench.tui.search_view import SearchView

    view = SimpleNamespace(note="", _draw=lambda: None)
    SearchView.handle(view, {"type": "revert", "point": "head", "locked_us": 2500.0, "reverted_us": 2510.0})
    assert view.note == "end to end: locked step 2.500 ms, 2.510 ms with head reverted"
    SearchView.handle(view, {"type": "dropped_as_noise", "choices": {"head": "triton", "sample": "triton"},
                             "band": 0.01, "before_us": 2500.0, "after_us": 2520.0})
    assert view.note == "end to end: dropped as noise head, sample: step 2.500 ms with them, 2.520 ms without"
    SearchView.handle(view, {"type": "paired", "choices": {"head": "triton"}, "gain": 0.012, "band": 0.005,
                             "rounds": [], "kept": True})
    assert view.note == "end to end: without head the step is 1.20% slower (paired, band 0.50%): kept"
    SearchView.handle(view, {"type": "challenger", "point": "experts", "variant": "triton_rows", "won": True})
    assert view.note == "end to end: experts:triton_rows tied with the choice at the op level: taken"


def test_search_view_shows_a_cached_result_gated_again():
    """A point cached under older gates shows as gated again, with what the gate found and what follows."""
    from types import SimpleNamespace

    from workbench.tui.search_view import SearchView

    view = SimpleNamespace(note="", state={"boundary": "queued"}, _draw=lambda: None)
    SearchView.handle(view, {"type": "regated", "point": "boundary", "variant": "triton", "config": None,
                             "was_failed": True, "passed": True})
    assert view.state["boundary"] == "gating again"
    assert view.note == ("boundary: cached gate failure triton gated again under the current gates: "
                         "passes: searching the point again")
    SearchView.handle(view, {"type": "regated", "point": "boundary", "variant": "cute", "config": None,
                             "was_failed": False, "passed": True})
    assert view.note == "boundary: cached choice cute gated again under the current gates: passes"


def test_search_view_takes_a_candidate_timed_again():
    """A re-timed candidate (its first timing past the noisy spread) is a new row and, where it led
    or now leads, the point's leader."""
    from types import SimpleNamespace

    from workbench.tui.search_view import SearchView

    rows = []
    first = {"variant": "triton", "config": {"num_warps": 4}, "step_us": 50.0}
    other = {"variant": "triton", "config": {"num_warps": 8}, "step_us": 70.0}
    view = SimpleNamespace(leader={"boundary": first}, candidates=[], _add_candidate_row=rows.append,
                           _draw=lambda: None)
    again = dict(first, step_us=90.0, noisy_timing={"step_us": 50.0, "spread": 0.4})
    SearchView.handle(view, {"type": "candidate_retimed", "point": "boundary", "result": again})
    assert view.leader["boundary"] is again and rows == [again]  # the leader's own, slower timing
    view.leader["boundary"] = other
    SearchView.handle(view, {"type": "candidate_retimed", "point": "boundary", "result": again})
    assert view.leader["boundary"] is other and rows == [again, again]  # slower than another leader


def test_a_later_run_resumes_finished_points_and_searches_the_skipped_one(session, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    async def drive():
        app = WorkbenchApp(options(session["out"]), start_search=True)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("p")  # hold the search before any candidate, then close it
            await wait_for(pilot, lambda: app.search_view.state.get(SKIPPED) != "queued", 60, "the skipped point")
            assert app.search_view.state == {"boundary": "resumed", SKIPPED: "gating & timing"}
            assert rows(app, "#search-candidates") == []  # boundary came from the run folder
            await pilot.press("q")

    asyncio.run(drive())


def test_a_broken_lock_file_shows_its_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # short relative paths to type
    bad = tmp_path / "lock.yaml"
    bad.write_text("points: [unclosed")

    async def drive():
        app = WorkbenchApp(lock_path=str(bad))
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            assert "not valid YAML" in text(app, "#lock-summary")
            assert app.query_one("#lock-entries", DataTable).row_count == 0
            await pilot.press("v")  # nothing to verify: says so, runs nothing
            assert app.lock_view.verdict == ""
            await pilot.press("o", "ctrl+a", "ctrl+k", *"absent.yaml", "enter")  # the open dialog, by keyboard
            assert "no lock file" in text(app, "#lock-summary")
            bad.write_text("schema: 1\n")
            await pilot.press("o", "ctrl+a", "ctrl+k", *"lock.yaml", "enter")
            assert "lacks the fields" in text(app, "#lock-summary")
            assert app.is_running

    asyncio.run(drive())


def test_help_screen_lists_the_bindings():
    async def drive():
        app = WorkbenchApp()
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)
            help_text = text(app, "#help-text")
            for words in ("pause/resume", "skip point", "verify", "open lock", "next view", "quit", "resumes"):
                assert words in help_text, words
            await pilot.press("escape")
            assert not isinstance(app.screen, HelpScreen)
            await pilot.press("tab")
            assert app.query_one("TabbedContent").active == "search"
            await pilot.press("shift+tab", "shift+tab")
            assert app.query_one("TabbedContent").active == "lock"

    asyncio.run(drive())


def read_search(run):
    """point -> the `result` of each search/<point>.json, read as the run wrote it."""
    out = {}
    for path in glob.glob(os.path.join(run, "search", "*.json")):
        with open(path) as f:
            out[os.path.basename(path)[:-len(".json")]] = json.load(f)["result"]
    return out


def test_a_finished_run_shows_its_search_results_and_the_device_it_ran_on():
    saved = read_search(DECODE_RUN)
    gpu = Lock.load(os.path.join(DECODE_RUN, "lock.yaml"))[0].environment["gpu"]
    with open(os.path.join(DECODE_RUN, "report.json")) as f:
        assert json.load(f)["environment"]["gpu"] == gpu  # the two records of the device agree
    # a point whose choice is not its first candidate, and a candidate of it that is not the choice
    point = next(p for p, r in sorted(saved.items()) if r["candidates"][0]["variant"] != r["choice"])
    other = next(c["variant"] for c in saved[point]["candidates"] if c["variant"] != saved[point]["choice"])

    async def drive():
        app = WorkbenchApp(options("unused"), run_dir=DECODE_RUN)  # options name this machine's CPU
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            assert gpu in app.sub_title and "cpu" not in app.sub_title, app.sub_title
            assert gpu in text(app, "#profile-summary")
            await pilot.press("2")
            points = {r[0]: r for r in rows(app, "#search-points")}
            assert set(points) == set(saved)
            assert points[point][6] == saved[point]["choice"]
            assert points[point][2] == str(len(saved[point]["candidates"]))
            candidates = rows(app, "#search-candidates")
            assert len(candidates) == sum(len(r["candidates"]) for r in saved.values())
            mine = [r for r in candidates if r[0] == point]
            assert [r[1].rstrip(" *") for r in mine] == [c["variant"] for c in saved[point]["candidates"]]
            assert other in {r[1] for r in mine}
            assert [r[1] for r in mine].count(saved[point]["choice"] + " *") == 1  # the choice, marked once
            assert all(r[2] in ("pass", "reference") or r[2].startswith(("FAIL", "skipped:")) for r in candidates)
            status = text(app, "#search-status")
            assert status.startswith(f"finished run: {len(saved)}/{len(saved)} points") and gpu in status, status
            assert not app.query_one("#search-problems").display
            await pilot.press(*["down"] * list(points).index(point))  # the candidates follow the point
            table = app.query_one("#search-candidates", DataTable)
            assert str(table.get_row_at(table.cursor_row)[1]) == saved[point]["choice"] + " *"
            assert text(app, "#search-detail").startswith(f"{point}:{saved[point]['choice']} (the search's choice)")

    asyncio.run(drive())


def test_a_run_folder_with_broken_files_names_each_in_its_view(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(os.path.join(DECODE_RUN, "search"), run / "search")
    for name in ("report.json", "lock.yaml"):
        shutil.copy(os.path.join(DECODE_RUN, name), run / name)
    saved = read_search(DECODE_RUN)
    broken, emptied, kept = sorted(saved)[:3]
    (run / "search" / f"{broken}.json").write_text('{"result": {"point": ')
    (run / "search" / f"{emptied}.json").write_text(json.dumps({"result": {"point": emptied}}))
    (run / "profile.json").write_text("[1, 2]")

    async def drive():
        app = WorkbenchApp(options("unused"), run_dir=str(run))
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            summary = text(app, "#profile-summary")
            assert f"{run / 'profile.json'}: holds a JSON list, not an object" in summary, summary
            await pilot.press("2")
            problems = text(app, "#search-problems")
            assert f"{run / 'search' / broken}.json: not valid JSON" in problems, problems
            assert f"{run / 'search' / emptied}.json: its result lacks 'choice'" in problems, problems
            points = {r[0] for r in rows(app, "#search-points")}
            assert kept in points and broken not in points and emptied not in points
            assert app.is_running

    asyncio.run(drive())
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    opts = tui_options(parser.parse_args(["--run", str(run)]))  # what g would search: the run's own
    assert (opts.target, opts.preset, opts.out_dir) == ("decode-b1", "beam-501b-tp8", str(run))


def test_an_empty_run_folder_says_what_is_missing(tmp_path):
    async def drive():
        app = WorkbenchApp(options("unused"), run_dir=str(tmp_path))
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            assert f"{tmp_path / 'profile.json'}: missing" in text(app, "#profile-summary")
            assert f"{tmp_path / 'search'}{os.sep}: missing" in text(app, "#search-problems")
            assert "device not recorded" in app.sub_title and "cpu" not in app.sub_title
            assert "no lock file" in text(app, "#lock-summary")

    asyncio.run(drive())
