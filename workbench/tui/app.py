"""The workbench's textual app: Profile, Search and Lock views in tabs, keyboard first.

It owns the worker threads (the optimize run, a live profile) and routes their results to the
views. It only calls the library API the CLI calls (`workbench.optimize.optimize`,
`workbench.profiler.profile_step`, `workbench.lock.verify`) and reads the files a run wrote;
it must never time, gate, rank or lock anything itself. The header names the device the shown
results were measured on: a finished run's recorded device, never the viewing machine's, until a
search or profile started here replaces them.
"""

from __future__ import annotations

import os

from textual.app import App
from textual.binding import Binding
from textual.widgets import Footer, Header, TabbedContent, TabPane

from workbench.dtypes import DTYPE_NAMES
from workbench.optimize import OptimizeOptions
from workbench.tui.help import HelpScreen
from workbench.tui.lock_view import LockView
from workbench.tui.profile_view import ProfileView
from workbench.tui.run_files import read_run
from workbench.tui.search_view import SearchView
from workbench.tui.session import OptimizeEvent, SearchSession, profile_target

VIEWS = ("profile", "search", "lock")
MAIN_WIDGET = {"profile": "#profile-points", "search": "#search-points", "lock": "#lock-entries"}


class WorkbenchApp(App):
    TITLE = "beam workbench"
    CSS = """
    #profile-points { height: 1fr; min-height: 8; }
    #point-details { height: 1fr; }
    #point-variants { width: 2fr; }
    #point-kernels { width: 1fr; }
    #search-points { height: auto; max-height: 14; }
    #search-candidates { height: 1fr; }
    #lock-entries { height: 1fr; }
    #profile-summary, #point-title, #search-status, #search-problems, #search-estimate, #search-detail,
    #lock-summary, #lock-detail, #lock-verdict { padding: 0 1; height: auto; }
    #search-detail, #lock-detail { background: $boost; }
    #point-title { background: $boost; }
    #open-lock { width: 80%; height: auto; padding: 1 2; background: $panel; border: tall $accent; }
    OpenLockScreen, HelpScreen { align: center middle; }
    #help { width: 90%; height: 90%; padding: 1 2; background: $panel; border: tall $accent; }
    """
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("question_mark", "help", "help"),
        Binding("tab", "next_view", "next view", priority=True),
        Binding("shift+tab", "previous_view", "previous view", priority=True),
        Binding("1", "view('profile')", "profile view", show=False),
        Binding("2", "view('search')", "search view", show=False),
        Binding("3", "view('lock')", "lock view", show=False),
        Binding("g", "start_search", "start search"),
        Binding("p", "pause", "pause/resume"),
        Binding("t", "toggle_theme", "light/dark"),
    ]

    def __init__(self, options: OptimizeOptions | None = None, *, run_dir: str | None = None,
                 lock_path: str | None = None, start_search: bool = False):
        super().__init__()
        self.options = options or OptimizeOptions()
        self.run_dir, self.lock_path, self.start_at_once = run_dir, lock_path, start_search
        self.session: SearchSession | None = None
        self.search_worker = None
        self.start_paused = False  # p before g: the next search waits before its first candidate

    def compose(self):
        yield Header()
        with TabbedContent(initial="profile", id="views"):
            with TabPane("Profile", id="profile"):
                yield ProfileView(self.options.device, id="profile-view")
            with TabPane("Search", id="search"):
                yield SearchView(id="search-view")
            with TabPane("Lock", id="lock"):
                yield LockView(self.options.device, id="lock-view")
        yield Footer()

    @property
    def profile_view(self) -> ProfileView:
        return self.query_one(ProfileView)

    @property
    def search_view(self) -> SearchView:
        return self.query_one(SearchView)

    @property
    def lock_view(self) -> LockView:
        return self.query_one(LockView)

    def on_mount(self) -> None:
        self.show_live_header()
        view = "profile"
        if self.run_dir:
            self.open_run(self.run_dir)
        if self.lock_path:
            self.lock_view.open(self.lock_path)
            view = "lock"
        if self.start_at_once:
            self.start_search()
            view = "search"
        self.action_view(view)

    def show_live_header(self) -> None:
        """The header for what this machine runs: the options' target, preset, dtype and device."""
        o = self.options
        self.sub_title = f"{o.target} on {o.preset} ({DTYPE_NAMES.get(o.dtype, o.dtype)}, {o.device})"

    def open_run(self, run_dir: str) -> None:
        """Show what a finished run folder holds (its profile, per-point search results and lock) and
        the device it was measured on; the views name any file that cannot be read."""
        run = read_run(run_dir)
        self.sub_title = f"{run.describe()}: run {run_dir}"
        self.profile_view.show_run(run)
        self.search_view.show_run(run)
        self.lock_view.open(run.lock_path)

    # ---- the search: started, steered and stopped here; shown by the views ----------------------
    @property
    def searching(self) -> bool:
        return self.search_worker is not None and not self.search_worker.is_finished

    def start_search(self) -> None:
        if self.searching:
            self.notify("a search is already running", severity="warning")
            return
        self.session = SearchSession(self.options, self.post_message)
        if self.start_paused:
            self.session.pause(True)
        self.search_view.start(self.options)
        self.profile_view.run_path = None  # what follows is measured here
        self.show_live_header()
        self.search_worker = self.run_worker(self.session.run, thread=True, name="optimize", exit_on_error=False)
        self.action_view("search")

    def action_start_search(self) -> None:
        self.start_search()

    def action_pause(self) -> None:
        if not self.searching:
            self.start_paused = not self.start_paused
            self.search_view.show_paused(self.start_paused)
            self.notify("the next search starts paused (g starts it, p resumes)" if self.start_paused
                        else "the next search starts at once")
            return
        paused = not self.session.paused
        self.session.pause(paused)
        self.search_view.show_paused(paused)
        self.notify("pausing after the current candidate" if paused else "resumed")

    def skip_point(self, point: str) -> bool:
        if not self.searching:
            self.notify("no search is running (g starts one)", severity="warning")
            return False
        self.session.skip(point)
        self.notify(f"{point}: no more candidates will be tried")
        return True

    def profile_now(self) -> None:
        self.notify(f"profiling {self.options.target} on {self.options.preset} ...")
        self.run_worker(lambda: profile_target(self.options), thread=True, name="profile", exit_on_error=False)

    def on_optimize_event(self, message: OptimizeEvent) -> None:
        e = message.event
        self.search_view.handle(e)
        kind = e["type"]
        if kind == "profile":
            self.profile_view.show_profile(e["profile"])
        elif kind == "candidate":
            self.profile_view.record_candidate(e["point"], e["result"])
        elif kind in ("point_done", "point_cached"):
            self.profile_view.record_result(e["point"], e["result"])
        elif kind == "done":
            path = os.path.join(self.options.out_dir, "lock.yaml")
            self.lock_view.open(path)
            self.notify(f"search done: wrote {path} (Lock view, 3)")

    def on_worker_state_changed(self, event) -> None:
        worker, state = event.worker, event.worker.state.name
        if worker.name == "optimize" and state == "ERROR":
            self.search_view.failed(f"{type(worker.error).__name__}: {worker.error}")
        elif worker.name == "profile" and state == "SUCCESS":
            self.profile_view.show_profile(worker.result)
            self.show_live_header()
        elif worker.name == "profile" and state == "ERROR":
            self.notify(f"profiling failed: {worker.error}", severity="error")

    def on_unmount(self) -> None:
        if self.session is not None:
            self.session.close()  # the run stops at its next event; finished points stay cached

    # ---- keys -------------------------------------------------------------------------------
    async def action_quit(self) -> None:
        if not self.searching:
            self.exit()
            return
        # The run's thread cannot be killed: it stops at its next event, which can take a while.
        self.session.close()
        self.exit(message=f"stopping the search after its current step; finished points stay cached in "
                          f"{self.options.out_dir} and the same command resumes the run")

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen([("everywhere", WorkbenchApp), ("Profile", ProfileView),
                                         ("Search", SearchView), ("Lock", LockView)]))

    def action_view(self, name: str) -> None:
        self.query_one(TabbedContent).active = name
        self.call_after_refresh(self.query_one(MAIN_WIDGET[name]).focus)

    def _step_view(self, step: int) -> None:
        if len(self.screen_stack) > 1:  # a dialog is open: tab belongs to it
            self.screen.focus_next() if step > 0 else self.screen.focus_previous()
            return
        current = self.query_one(TabbedContent).active
        self.action_view(VIEWS[(VIEWS.index(current) + step) % len(VIEWS)])

    def action_next_view(self) -> None:
        self._step_view(1)

    def action_previous_view(self) -> None:
        self._step_view(-1)

    def action_toggle_theme(self) -> None:
        self.theme = "textual-light" if self.theme != "textual-light" else "textual-dark"

    def watch_theme(self, theme: str) -> None:
        # Cells take their colours when drawn: redraw them in the new theme's colours.
        for view in self.query("ProfileView, SearchView, LockView"):
            view.redraw()
