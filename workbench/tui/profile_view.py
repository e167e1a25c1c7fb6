"""Profile view: where the target's step time goes, per fusion point, and what the search found.

Shows a `workbench.profiler.Profile` (live from a run's "profile" event, or a finished run folder's
`profile.json`) as a table sorted by cost with a bar per row; the highlighted point's variants
(registry, plus the gate status and timings the search recorded) and its kernels (as the profile
recorded them). A run folder's profile that cannot be read is named with its problem in the summary.
Presentation only: it never profiles, times or gates anything itself, and it never judges a finished
run's variants by what the viewing machine can run.
"""

from __future__ import annotations

from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.markup import escape
from textual.widgets import DataTable, Static

from workbench.profiler import Profile
from workbench.profiler.trace import short_name
from workbench.registry import REFERENCE, variants
from workbench.tui.style import bar, candidate_status, clip, config_line, num, percent, styled

CONFIG_WIDTH, GATE_WIDTH, KERNEL_WIDTH = 22, 14, 30  # cells; the Search view shows candidates whole


class ProfileView(Vertical):
    BINDINGS = [
        Binding("escape", "points", "back to points", show=False),
        Binding("r", "profile_now", "profile now"),
    ]

    def __init__(self, device=None, **kw):
        super().__init__(**kw)
        self.device = device
        self.profile: Profile | None = None
        self.results: dict[str, dict] = {}          # point -> PointResult dict (search done or cached)
        self.live: dict[str, list[dict]] = {}       # point -> candidates arriving now
        self.selected: str | None = None
        self.run_path: str | None = None             # set when the results are a finished run folder's

    def compose(self):
        yield Static("No profile yet: press r to profile the target, or g in the Search view to run a search.",
                     id="profile-summary")
        yield DataTable(id="profile-points", cursor_type="row", zebra_stripes=True)
        yield Static("", id="point-title")
        with Horizontal(id="point-details"):
            yield DataTable(id="point-variants", cursor_type="row")
            yield DataTable(id="point-kernels", cursor_type="row")

    def on_mount(self) -> None:
        self.query_one("#profile-points", DataTable).add_columns(
            "point", "us/step", "share", "", "kernels", "% of floor", "variant")
        self.query_one("#point-variants", DataTable).add_columns(
            "variant", "backend", "gate", "us/step", "speed-up", "config")
        self.query_one("#point-kernels", DataTable).add_columns("kernel", "count", "us/step")

    # ---- data in -----------------------------------------------------------------------------
    def show_run(self, run) -> None:
        """A finished run folder (`workbench.tui.run_files.RunFiles`): its profile and search results."""
        self.run_path = run.path
        for point, result in run.results.items():
            self.results[point] = result
        if run.profile is not None:
            self.show_profile(run.profile)
        problems = run.problems.get("profile", [])
        if problems:
            self.query_one("#profile-summary", Static).update(styled(
                self.app, "cannot show the profile:\n" + "\n".join(f"- {p}" for p in problems), "error", bold=True))

    def show_profile(self, profile: Profile) -> None:
        self.profile = profile
        unit = "device" if profile.time_unit == "device" else "CPU"
        self.query_one("#profile-summary", Static).update(
            f"[b]{profile.target}[/] on {profile.preset} ({profile.dtype}, {profile.device}): "
            f"[b]{profile.total_us / 1e3:.3f} ms[/] of {unit} time per step, {profile.kernels_per_step} kernels "
            f"({profile.unattributed_us:.0f} us outside the fusion points); kernels per layer "
            + escape(str(profile.kernels_per_layer)))
        self._fill_points()

    def record_result(self, point: str, result: dict) -> None:
        self.results[point] = result
        self.live.pop(point, None)
        if point == self.selected:
            self._show_point(point)

    def record_candidate(self, point: str, candidate: dict) -> None:
        self.live.setdefault(point, []).append(candidate)
        if point == self.selected:
            self._show_point(point)

    # ---- drawing ------------------------------------------------------------------------------
    def redraw(self) -> None:
        if self.profile is not None:
            self._fill_points()

    def _fill_points(self) -> None:
        table = self.query_one("#profile-points", DataTable)
        table.clear()
        top = max((p.share for p in self.profile.points), default=0.0) or 1.0
        by_cost = sorted(self.profile.points, key=lambda p: -p.time_us)
        for p in by_cost:
            of_floor = p.floor_us / p.time_us if p.floor_us and p.time_us else None
            table.add_row(p.point, num(p.time_us), percent(p.share), bar(self.app, p.share / top),
                          str(p.kernels), percent(of_floor), p.variant, key=p.point)
        names = [p.point for p in by_cost]
        if names:
            point = self.selected if self.selected in names else names[0]
            table.move_cursor(row=names.index(point))  # a redraw keeps the highlighted point
            self._show_point(point)

    def _show_point(self, point: str) -> None:
        self.selected = point
        prof = next((p for p in self.profile.points if p.point == point), None) if self.profile else None
        result = self.results.get(point)
        candidates = result["candidates"] if result else self.live.get(point, [])
        state = (f"search chose [b]{escape(result['choice'])}[/]" if result else
                 "search running" if point in self.live else "not searched in this run")
        calls = ", ".join(f"{k} {n}" for k, n in prof.calls_by_kind.items()) if prof else "-"
        self.query_one("#point-title", Static).update(
            f"[b]{point}[/]: {prof.calls if prof else '-'} calls per step ({calls}); {state}")
        vt = self.query_one("#point-variants", DataTable)
        vt.clear()
        tried, chosen_row = {c["variant"] for c in candidates}, None
        for i, c in enumerate(candidates):
            chosen = bool(result) and (c["variant"], c["config"] or None) == (result["choice"],
                                                                               result.get("config") or None)
            chosen_row = i if chosen else chosen_row
            vt.add_row(styled(self.app, c["variant"] + (" *" if chosen else ""), "success" if chosen else None,
                              bold=chosen), c["backend"] or "-", candidate_status(self.app, c, GATE_WIDTH),
                       num(c["step_us"]), num(c["speedup"], "x{:.2f}"), config_line(c["config"], CONFIG_WIDTH))
        try:
            registered = variants(point)
        except KeyError:  # a point a finished run searched that this tree no longer registers
            registered = {}
        for name, v in registered.items():
            if name in tried:
                continue
            # A finished run's variants are not judged by what this machine can run.
            why = None if self.run_path else v.unsupported(None, self.device)
            gate = (styled(self.app, f"unavailable: {why}", "warning") if why else
                    styled(self.app, "reference" if name == REFERENCE else
                           "not in this run" if self.run_path else "not searched", "muted"))
            vt.add_row(name, v.backend, gate, "-", "-", "")
        if chosen_row is not None:
            vt.move_cursor(row=chosen_row)  # the choice in view however many candidates come before it
        kt = self.query_one("#point-kernels", DataTable)
        kt.clear()
        for name, count, us in (prof.top_kernels if prof else []):
            kt.add_row(clip(short_name(name), KERNEL_WIDTH), str(count), num(us))

    # ---- keys ---------------------------------------------------------------------------------
    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table.id == "profile-points" and event.row_key.value:
            self._show_point(event.row_key.value)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if event.data_table.id == "profile-points":
            self.action_variants()

    def action_variants(self) -> None:
        self.query_one("#point-variants", DataTable).focus()

    def action_points(self) -> None:
        self.query_one("#profile-points", DataTable).focus()

    def action_profile_now(self) -> None:
        self.app.profile_now()
