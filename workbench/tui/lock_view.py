"""Lock view: a lock file's header and entries, and `verify` run from the UI.

Reads with `workbench.lock.Lock.load` (a broken file is shown as its error, never a crash) and
re-checks with `workbench.lock.verify` in a worker thread (sources, environment, digest, then the
gates). Presentation only: it never edits a lock and never judges one beyond what `verify` says.
"""

from __future__ import annotations

from rich.text import Text
from textual.binding import Binding
from textual.containers import Vertical
from textual.markup import escape
from textual.screen import ModalScreen
from textual.widgets import DataTable, Input, Label, Static

from workbench.lock import Lock, LockError, verify
from workbench.tui.style import config_line, num, styled

CONFIG_WIDTH = 42  # a table cell; the highlighted entry's line below shows it whole


class OpenLockScreen(ModalScreen[str]):
    """Ask for a lock file's path (enter opens, escape cancels)."""

    BINDINGS = [Binding("escape", "dismiss", "cancel")]

    def __init__(self, path: str = ""):
        super().__init__()
        self.path = path

    def compose(self):
        with Vertical(id="open-lock"):
            yield Label("Lock file to open (enter opens, escape cancels):")
            yield Input(self.path, id="lock-path")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip())


class LockView(Vertical):
    BINDINGS = [
        Binding("o", "open", "open lock"),
        Binding("v", "verify", "verify"),
    ]

    def __init__(self, device=None, **kw):
        super().__init__(**kw)
        self.device = device
        self.path: str | None = None
        self.lock: Lock | None = None
        self.verdict, self.verdict_role = "", None   # the last verification, as shown

    def compose(self):
        yield Static("No lock open: press o to open one.", id="lock-summary")
        yield DataTable(id="lock-entries", cursor_type="row", zebra_stripes=True)
        yield Static("", id="lock-detail")
        yield Static("", id="lock-verdict")

    def on_mount(self) -> None:
        self.query_one("#lock-entries", DataTable).add_columns(
            "point", "variant", "backend", "us/step", "reference us/step", "gate", "source hash", "config")

    # ---- data in -----------------------------------------------------------------------------
    def open(self, path: str) -> None:
        table, summary = self.query_one("#lock-entries", DataTable), self.query_one("#lock-summary", Static)
        table.clear()
        self.path, self.lock = path, None
        self.query_one("#lock-detail", Static).update("")
        self._verdict("")
        try:
            lock, problems = Lock.load(path)
            self._fill(lock)
        except Exception as e:  # a file this view cannot show is reported, whatever is wrong with it
            table.clear()
            what = str(e) if isinstance(e, LockError) else f"{type(e).__name__}: {e}"
            summary.update(styled(self.app, f"cannot open {path}: {what}", "error", bold=True))
            return
        self.lock = lock
        if problems:
            self._verdict("problems on reading:\n" + "\n".join(f"- {p}" for p in problems), "error")

    def redraw(self) -> None:
        if self.lock is not None:
            self.query_one("#lock-entries", DataTable).clear()
            self._fill(self.lock)
        self._verdict(self.verdict, self.verdict_role)

    def _fill(self, lock: Lock) -> None:
        m, e2e = lock.model, lock.end_to_end or {}
        env = ", ".join(f"{k} {lock.environment.get(k)}" for k in ("gpu", "torch", "triton") if k in lock.environment)
        speed = (f"; reference {e2e['reference_us'] / 1e3:.3f} ms -> locked {e2e['locked_us'] / 1e3:.3f} ms per step"
                 if e2e.get("reference_us") and e2e.get("locked_us") else "")
        self.query_one("#lock-summary", Static).update(
            f"[b]{escape(self.path)}[/]\n" + escape(
                f"target {lock.target}, model {m.get('preset')} ({m.get('dtype')}, config {m.get('config_hash')}), "
                f"created {lock.created}\nenvironment: {env or '-'}{speed}\ncommand: {lock.command or '-'}"))
        table = self.query_one("#lock-entries", DataTable)
        for point, e in lock.points.items():
            timing, gate = e.get("timing") or {}, e.get("gate") or {}
            gate_text = (styled(self.app, "reference", "primary") if gate.get("reference") else
                         styled(self.app, "passed", "success") if gate.get("passed") else
                         styled(self.app, "no evidence", "error"))
            table.add_row(point, e["variant"], e.get("backend", "?"), num(timing.get("step_us")),
                          num(timing.get("reference_us")), gate_text, str(e.get("source_hash")),
                          config_line(e.get("config"), CONFIG_WIDTH), key=point)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        """The highlighted entry's config whole (the table cuts it)."""
        if event.data_table.id != "lock-entries" or self.lock is None or event.row_key.value not in self.lock.points:
            return
        point = event.row_key.value
        e = self.lock.points[point]
        self.query_one("#lock-detail", Static).update(
            Text(f"{point}:{e['variant']}", style="bold") + Text(f"  {config_line(e.get('config')) or 'no config'}"))

    def show_verification(self, result) -> None:
        notes = "".join(f"\nnote: {n}" for n in result.notes)
        if result.ok:
            self._verdict(f"verify OK: digest, sources, environment and gates all hold ({self.path})" + notes,
                          "success")
        else:
            self._verdict("verify FAILED:\n" + "\n".join(f"- {p}" for p in result.problems) + notes, "error")

    def verify_failed(self, message: str) -> None:
        self._verdict(f"verify could not run: {message}", "error")

    def _verdict(self, text: str, role: str | None = None) -> None:
        self.verdict, self.verdict_role = text, role
        self.query_one("#lock-verdict", Static).update(styled(self.app, text, role, bold=True) if role else text)

    # ---- keys ---------------------------------------------------------------------------------
    def action_open(self) -> None:
        def opened(path: str | None) -> None:
            if path:
                self.open(path)
        self.app.push_screen(OpenLockScreen(self.path or ""), opened)

    def action_verify(self) -> None:
        if self.lock is None:
            self.app.notify("open a lock first (o)", severity="warning")
            return
        self._verdict(f"verifying {self.path}: sources, environment, then the gates ...", "accent")
        self.run_worker(lambda: verify(self.path, run_gates=True, device=self.device), thread=True,
                        name="verify", exit_on_error=False)

    def on_worker_state_changed(self, event) -> None:
        if event.worker.name != "verify":
            return
        if event.worker.state.name == "SUCCESS":
            self.show_verification(event.worker.result)
        elif event.worker.state.name == "ERROR":
            self.verify_failed(str(event.worker.error))
