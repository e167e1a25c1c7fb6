"""Help screen (`?`): every key binding, read from the views' own binding lists, and how a run
behaves when it is paused, skipped or closed. Presentation only: it never runs anything."""

from __future__ import annotations

from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

NOTES = """\
[b]Navigation[/]  Arrow keys move, enter selects: in the Profile view enter on a point moves into its \
variants, escape goes back. No mouse is needed; everything works over SSH.

[b]Pause[/]  p asks the search to wait before its next candidate: the candidate being gated or timed \
finishes first. p again resumes. p before g starts the next search paused.

[b]Skip[/]  s on a highlighted point in the Search view: no more of its candidates are tried. Its reference \
is still timed (the lock needs it), and a skipped point is not cached, so a later run searches it.

[b]Closing mid-run[/]  q stops the run after the current candidate. Every point already searched is cached in \
the run folder (search/<point>.json, keyed by the variants' source hashes): start the same search again \
(g here, `workbench tui` or `workbench optimize` with the same --out) and it resumes where it stopped.

[b]Verify[/]  v in the Lock view runs `workbench lock verify` on the open lock: digest, source hashes, \
environment, then the gates again.

[b]Colours[/]  come from the theme (t switches light/dark; the command palette, ctrl+p, has more, \
including ansi themes that use the terminal's own palette).
"""


def binding_rows(app, owners) -> list[tuple[str, str, str]]:
    """(where, keys, what) for every binding with a description on the given classes."""
    rows = []
    for where, cls in owners:
        for b in cls.BINDINGS:
            b = b if isinstance(b, Binding) else Binding(*b)
            if b.description:
                rows.append((where, app.get_key_display(b), b.description))
    return rows


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "close help")]

    def __init__(self, owners):
        super().__init__()
        self.owners = owners

    def compose(self):
        rows = binding_rows(self.app, self.owners)
        keys = "\n".join(f"  [b]{keys:<12}[/] {what:<18} [dim]{where}[/]" for where, keys, what in rows)
        with VerticalScroll(id="help"):
            yield Static(f"[b]Keys[/]\n{keys}\n\n{NOTES}", id="help-text")
