"""Live search view: an optimize run as it happens, and the keys that steer it.

Per point: queued, gating & timing, done (or resumed from the run folder, gated again first when its
results were cached under older gates, or skipped); each
candidate's result as it arrives (pass, or FAIL with the failing check; median us per step, spread,
speed-up); the incumbent set and a running end-to-end estimate (the profiled step minus the
savings the search has measured so far), then the measured end-to-end result and the locked set.
A finished run folder (`workbench tui --run DIR`) is drawn from its files instead (`show_run`): every
point's candidates as the run recorded them, its choice marked, the run's end-to-end result and the
device it was measured on; a file that cannot be read is named with its problem above the tables.
Presentation only: it draws the events `workbench.optimize` emits or the files a run wrote, and
forwards `s` to the app; it never decides, re-ranks or recomputes anything.
"""

from __future__ import annotations

from rich.text import Text
from textual.binding import Binding
from textual.containers import Vertical
from textual.markup import escape
from textual.widgets import DataTable, Static

from workbench.registry import REFERENCE
from workbench.report import regated_words, slower_by
from workbench.tui.style import (
    candidate_status,
    candidate_words,
    config_line,
    num,
    percent,
    styled,
)

CONFIG_WIDTH, GATE_WIDTH = 44, 28  # table cells; the highlighted candidate's line below shows them whole
FINISHED = "finished run"
_ROLE = {"queued": "muted", "gating again": "accent", "gating & timing": "accent", "done": "success",
         "resumed": "success",
         "skipped": "warning", "skip asked": "warning"}


class SearchView(Vertical):
    BINDINGS = [Binding("s", "skip", "skip point")]  # g (start) and p (pause) work in every view

    def __init__(self, **kw):
        super().__init__(**kw)
        self.reset()

    def reset(self, points=()) -> None:
        self.points = list(points)
        self.state = {p: "queued" for p in self.points}
        self.tried: dict[str, int] = {}
        self.passed: dict[str, int] = {}
        self.leader: dict[str, dict] = {}   # fastest passing candidate so far, per point
        self.results: dict[str, dict] = {}  # point -> PointResult dict
        self.candidates: list[dict] = []    # every candidate result, in arrival order
        self.stage, self.note = "not started", ""
        self.profile_us: float | None = None
        self.locked: dict[str, str] | None = None  # the lock's selection, once written
        self.paused = False
        self.problems: list[str] = []       # files of an opened run folder that could not be read

    def compose(self):
        yield Static("Press g to start a search.", id="search-status")
        yield Static("", id="search-problems")
        yield Static("", id="search-estimate")
        yield DataTable(id="search-points", cursor_type="row")
        yield DataTable(id="search-candidates", cursor_type="row", zebra_stripes=True)
        yield Static("", id="search-detail")

    def on_mount(self) -> None:
        self.query_one("#search-points", DataTable).add_columns(
            "point", "state", "tried", "passed", "reference us", "best us", "choice", "speed-up")
        self.query_one("#search-candidates", DataTable).add_columns(
            "point", "variant", "gate", "us/step", "spread", "speed-up", "config")
        self.query_one("#search-problems", Static).display = False

    # ---- events in ----------------------------------------------------------------------------
    def start(self, options) -> None:
        self.reset(options.points)
        self.stage = "starting"
        self.note = f"{options.target} on {options.preset}, run folder {options.out_dir}"
        self.query_one("#search-candidates", DataTable).clear()
        self._draw()

    def show_run(self, run) -> None:
        """A finished run folder (`workbench.tui.run_files.RunFiles`): its points by reference time,
        every candidate each recorded, the choices and the lock the run wrote."""
        results = run.results
        self.reset(sorted(results, key=lambda p: -results[p]["reference_us"]))
        self.stage, self.problems = FINISHED, list(run.problems.get("search", []))
        for p in self.points:
            self.state[p] = "done"
            for c in results[p]["candidates"]:
                self._count(p, c)
        self.results, self.locked = dict(results), run.locked()
        self.candidates = [c for p in self.points for c in results[p]["candidates"]]
        self.note = f"{run.path}, measured on {run.device or 'a device the run did not record'}"
        report = run.report
        if report is None:
            self.note += "; no report.json: the run's end-to-end stage did not finish"
        elif all(isinstance(report.get(k), (int, float)) for k in ("reference_ms", "locked_ms", "speedup")):
            compiled = report.get("torch_compile_ms")
            compiled = f"; torch.compile build {compiled:.3f} ms" if isinstance(compiled, (int, float)) else ""
            self.note += (f"; reference {report['reference_ms']:.3f} ms -> locked {report['locked_ms']:.3f} ms "
                          f"per step (x{report['speedup']:.2f}{compiled})")
        self.redraw()
        self._show_point_candidates(0)

    def redraw(self) -> None:
        self._fill_candidates()
        self._draw()

    def _fill_candidates(self) -> None:
        self.query_one("#search-candidates", DataTable).clear()
        for r in self.candidates:
            self._add_candidate_row(r, follow=self.stage != FINISHED)

    def handle(self, e: dict) -> None:
        kind = e["type"]
        if kind == "stage":
            self.stage = e["stage"]
            if "order" in e:  # the search's ranking: show points in the order they will be searched
                self.points = list(e["order"])
                self.state = {p: self.state.get(p, "queued") for p in self.points}
        elif kind == "profile":
            self.profile_us = e["profile"].total_us
        elif kind == "regated":
            self.state[e["point"]] = "gating again"
            self.note = f"{e['point']}: {regated_words(e['variant'], e['passed'], e['was_failed'])}"
        elif kind == "point_start":
            self.state[e["point"]] = "skip asked" if self.state.get(e["point"]) == "skip asked" \
                else "gating & timing"
        elif kind == "candidate":
            self._candidate(e["point"], e["result"])
        elif kind == "candidate_retimed":  # a new row with the quieter timing; point_done settles the choice
            r, leader = e["result"], self.leader.get(e["point"])
            if leader is None or r["step_us"] < leader["step_us"] or \
                    (leader["variant"], leader["config"]) == (r["variant"], r["config"]):
                self.leader[e["point"]] = r
            self.candidates.append(r)
            self._add_candidate_row(r)
        elif kind in ("point_done", "point_cached"):
            p = e["point"]
            self.results[p] = e["result"]
            self.state[p] = "resumed" if kind == "point_cached" else \
                "skipped" if self.state.get(p) == "skip asked" else "done"
            self._fill_candidates()  # the choice is marked now that it is known
        elif kind == "revert":
            self.note = (f"end to end: locked step {e['locked_us'] / 1e3:.3f} ms, "
                         f"{e['reverted_us'] / 1e3:.3f} ms with {e['point']} reverted")
        elif kind == "challenger":
            self.note = (f"end to end: {e['point']}:{e['variant']} tied with the choice at the op level: "
                         f"{'taken' if e['won'] else 'not taken'}")
        elif kind == "paired":
            self.note = (f"end to end: without {', '.join(e['choices'])} the step is {slower_by(e['gain'])} "
                         f"(paired, band {100 * e['band']:.2f}%): {'kept' if e['kept'] else 'dropped'}")
        elif kind == "dropped_as_noise":
            self.note = (f"end to end: dropped as noise {', '.join(e['choices'])}: step {e['before_us'] / 1e3:.3f} ms "
                         f"with them, {e['after_us'] / 1e3:.3f} ms without")
        elif kind == "stopped":
            self.stage = "stopped"
            self.note = f"budget spent; pending {', '.join(e['pending'])}: the same command resumes the run"
        elif kind == "done":
            r = e["report"]
            self.stage = "done"
            self.locked = {p["point"]: p["variant"] for p in r["points"] if p["variant"] != REFERENCE}
            compiled = f"{r['torch_compile_ms']:.3f} ms" if r["torch_compile_ms"] else "failed"
            self.note = (f"reference {r['reference_ms']:.3f} ms -> locked {r['locked_ms']:.3f} ms per step "
                         f"(x{r['speedup']:.2f}; torch.compile build {compiled}); lock written")
        self._draw()

    def show_paused(self, paused: bool) -> None:
        self.paused = paused
        self._draw()

    def failed(self, message: str) -> None:
        self.stage, self.note = "failed", message
        self._draw()

    def _count(self, point: str, r: dict) -> None:
        self.tried[point] = self.tried.get(point, 0) + 1
        if r["step_us"] is not None:
            self.passed[point] = self.passed.get(point, 0) + 1
            if point not in self.leader or r["step_us"] < self.leader[point]["step_us"]:
                self.leader[point] = r

    def _candidate(self, point: str, r: dict) -> None:
        self._count(point, r)
        self.candidates.append(r)
        self._add_candidate_row(r)

    def _chosen(self, r: dict) -> bool:
        result = self.results.get(r["point"])
        return bool(result) and (r["variant"], r["config"] or None) == (result["choice"], result.get("config") or None)

    def _add_candidate_row(self, r: dict, follow: bool = True) -> None:
        table = self.query_one("#search-candidates", DataTable)
        chosen = self._chosen(r)
        variant = styled(self.app, r["variant"] + (" *" if chosen else ""), "success" if chosen else None, bold=chosen)
        table.add_row(r["point"], variant,
                      candidate_status(self.app, r, GATE_WIDTH), num(r["step_us"]), percent(r["spread"]),
                      num(r["speedup"], "x{:.2f}"), config_line(r["config"], CONFIG_WIDTH))
        if follow:
            table.move_cursor(row=table.row_count - 1)  # follow the newest result

    def _show_point_candidates(self, row: int) -> None:
        """A finished run: the candidates table moves to the highlighted point's choice."""
        if not self.points:
            return
        point = self.points[min(row, len(self.points) - 1)]
        rows = [i for i, c in enumerate(self.candidates) if c["point"] == point]
        chosen = [i for i in rows if self._chosen(self.candidates[i])]
        if rows:
            table = self.query_one("#search-candidates", DataTable)
            row = (chosen or rows)[0]
            table.move_cursor(row=row)
            if row - rows[0] < table.scrollable_content_region.height:  # the point's first rows at the top
                table.call_after_refresh(table.scroll_to, y=rows[0], animate=False)

    def _show_detail(self, row: int) -> None:
        """The highlighted candidate whole: its config and its gate outcome uncut."""
        detail = self.query_one("#search-detail", Static)
        if not 0 <= row < len(self.candidates):
            detail.update("")
            return
        r = self.candidates[row]
        words, role, _ = candidate_words(r)
        chosen = " (the search's choice)" if self._chosen(r) else ""
        line = Text(f"{r['point']}:{r['variant']}{chosen}", style="bold")
        line.append(f"  {config_line(r['config']) or 'no config'}\n")
        line.append_text(styled(self.app, words, role))
        detail.update(line)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table.id == "search-candidates":
            self._show_detail(event.cursor_row)
        elif event.data_table.id == "search-points" and self.stage == FINISHED:
            self._show_point_candidates(event.cursor_row)

    # ---- drawing ------------------------------------------------------------------------------
    def _draw(self) -> None:
        problems = self.query_one("#search-problems", Static)
        problems.display = bool(self.problems)
        problems.update(styled(self.app, "cannot show:\n" + "\n".join(f"- {p}" for p in self.problems), "error",
                               bold=True) if self.problems else "")
        paused = " [b]paused[/] (after the current candidate)" if self.paused else ""
        done = sum(s in ("done", "resumed", "skipped") for s in self.state.values())
        self.query_one("#search-status", Static).update(
            f"[b]{self.stage}[/]{paused}: {done}/{len(self.points)} points"
            + (f" -- {escape(self.note)}" if self.note else ""))
        self.query_one("#search-estimate", Static).update(self._incumbents())
        table = self.query_one("#search-points", DataTable)
        row = table.cursor_row
        table.clear()
        for p in self.points:
            r, lead = self.results.get(p), self.leader.get(p)
            best = r["choice_us"] if r else lead["step_us"] if lead else None
            table.add_row(p, styled(self.app, self.state[p], _ROLE[self.state[p]]), str(self.tried.get(p, 0)),
                          str(self.passed.get(p, 0)), num(r["reference_us"]) if r else "-", num(best),
                          r["choice"] if r else (f"{lead['variant']} (leading)" if lead else "-"),
                          num(r["reference_us"] / r["choice_us"], "x{:.2f}") if r else "-", key=p)
        if self.points:
            table.move_cursor(row=min(row, len(self.points) - 1))

    def _incumbents(self) -> str:
        """The set the search holds now and the step it points to; once done, the set that was locked."""
        def listed(sel):
            return ", ".join(f"{p}={v}" for p, v in sel.items()) or "reference everywhere"

        chosen = {p: r["choice"] for p, r in self.results.items() if r["choice"] != REFERENCE}
        if self.locked is not None:
            dropped = [p for p in chosen if p not in self.locked]
            why = f"; dropped end to end (no step gain beyond the noise): {', '.join(dropped)}" if dropped else ""
            return f"locked: {listed(self.locked)}{why}"
        if not self.profile_us:
            return f"incumbents: {listed(chosen)}"
        saved = sum(r["reference_us"] - r["choice_us"] for r in self.results.values())
        return (f"incumbents: {listed(chosen)}; estimated step {(self.profile_us - saved) / 1e3:.3f} ms "
                f"(profiled {self.profile_us / 1e3:.3f} ms minus {saved:.0f} us measured savings)")

    # ---- keys ---------------------------------------------------------------------------------
    def action_skip(self) -> None:
        table = self.query_one("#search-points", DataTable)
        if not self.points:
            return
        point = self.points[table.cursor_row]
        if self.state.get(point) not in ("queued", "gating & timing"):
            self.app.notify(f"{point} is {self.state.get(point)}: nothing to skip", severity="warning")
            return
        if self.app.skip_point(point):
            self.state[point] = "skip asked"
            self._draw()
