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


def clip(text: str, limit: int | None) -> str:
    """`text`'s first line, cut to `limit` characters with an ellipsis (whole when limit is None)."""
    if limit is None:
        return text
    lines = text.splitlines() or [""]
    line, more = lines[0], len(lines) > 1
    if len(line) + more > limit:
        line, more = line[:limit - 1], True
    return line + ("…" if more else "")


def config_line(config, limit: int | None = None) -> str:
    """A variant's config as `key=value` pairs (a compound's member configs in brackets), or ""."""
    def pairs(c) -> str:
        return " ".join(f"{k}({pairs(v)})" if isinstance(v, dict) else f"{k}={v}" for k, v in c.items())

    if not config:
        return ""
    return clip(pairs(config) if isinstance(config, dict) else str(config), limit)


def candidate_words(r: dict) -> tuple[str, str | None, bool]:
    """A candidate's gate outcome in words, its colour role and boldness: reference, pass, FAIL (the
    failing check) or skipped (why)."""
    if r.get("skipped"):
        return f"skipped: {r['skipped']}", "warning", False
    if r.get("variant") == REFERENCE and not r.get("gate"):
        return "reference", "primary", False
    if not r.get("gate_passed"):
        return f"FAIL {r.get('failed_check') or ''}".rstrip(), "error", True
    return "pass", "success", True


def candidate_status(app, r: dict, limit: int | None = None) -> Text:
    """A candidate's gate outcome as a table cell, its first line cut to `limit` characters."""
    words, role, bold = candidate_words(r)
    return styled(app, clip(words, limit), role, bold=bold)
