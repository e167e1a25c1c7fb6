"""Colours and small cell renderables shared by the TUI's views.

Every colour is a variable of the active textual theme (`text-success`, `text-error`, ...), read
when a cell is drawn, so the UI stays readable on light and dark themes and terminals alike. Never
hard-code a colour here, and never compute a measurement: this module only formats.
"""

from __future__ import annotations

from rich.errors import StyleSyntaxError
from rich.style import Style
from rich.text import Text

from workbench.registry import REFERENCE

_EIGHTHS = " ▏▎▍▌▋▊▉"
_ANSI = {"success": "green", "error": "red", "warning": "yellow", "accent": "cyan", "primary": "blue"}


def tone(app, role: str) -> str:
    """The theme's text colour for a role (success, error, warning, accent, primary; muted is dim)."""
    if role == "muted":
        return "dim"
    colour = app.theme_variables.get(f"text-{role}") or app.theme_variables.get(role, "")
    try:
        Style.parse(colour)
    except StyleSyntaxError:  # ANSI themes name terminal colours: the terminal's own palette then
        colour = ""
    return colour or _ANSI.get(role, "")


def styled(app, text: str, role: str | None = None, *, bold: bool = False) -> Text:
    style = " ".join(s for s in (tone(app, role) if role else "", "bold" if bold else "") if s)
    return Text(text, style=style)


def bar(app, fraction: float, width: int = 16) -> Text:
    """A horizontal bar of `fraction` (0..1) of `width` cells, in eighths of a cell."""
    eighths = round(max(0.0, min(1.0, fraction)) * width * 8)
    full, part = divmod(eighths, 8)
    return Text("█" * full + (_EIGHTHS[part] if part else ""), style=tone(app, "accent"))


def num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def candidate_status(app, r: dict) -> Text:
    """A candidate's gate outcome: reference, pass, FAIL (the failing check) or skipped (why)."""
    if r.get("skipped"):
        return styled(app, f"skipped: {r['skipped']}", "warning")
    if r.get("variant") == REFERENCE and not r.get("gate"):
        return styled(app, "reference", "primary")
    if not r.get("gate_passed"):
        return styled(app, f"FAIL {r.get('failed_check') or ''}".rstrip(), "error", bold=True)
    return styled(app, "pass", "success", bold=True)
