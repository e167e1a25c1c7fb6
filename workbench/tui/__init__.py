"""The terminal UI (`workbench tui`, `workbench optimize --tui`): watch and steer a profile, a search
and a lock from the keyboard.

Presentation only: every number it shows comes from the library API the CLI uses (`optimize`,
`profile_step`, `Lock.load`, `verify`) or from the files a run wrote. It must never time, gate,
rank or choose anything itself, and nothing under `workbench/` outside this package imports it.
"""

from workbench.tui.app import WorkbenchApp

__all__ = ["WorkbenchApp"]
