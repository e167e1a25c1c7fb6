"""Where an agent's candidate runs once registered: in a sandbox, or imported.

A process that judges, times or locks (`workbench optimize --agent`, `workbench lock verify`) never
imports a candidate: `load_sandboxed` registers it as a variant whose calls run in a sandbox process of
its own (`workbench.agent.sandbox`), so code that runs on import changes only that process. A process
that serves a lock imports the locked file as it is (`plugins.load_file`).
"""

from __future__ import annotations

import os

from workbench import registry
from workbench.agent.plugins import PluginError, declared, free_names, load_file, unload
from workbench.agent.sandbox import Sandbox, SandboxError

_SANDBOXES: list = []  # the sandboxes `load_sandboxed` started in this process, closed by `close_sandboxed`


def load_sandboxed(path: str, *, device="cpu", static: bool = True) -> list[registry.Variant]:
    """Register the variants a plugin file declares without importing it here: each runs in a sandbox
    process that imports the file (after the static check) and answers calls on shared tensors.
    Raises PluginError when the file fails to load there."""
    path = os.path.abspath(path)
    names = free_names(path)
    if not names:
        raise PluginError(f"{path} registers no variant (use @register(POINT, NAME, BACKEND) with literal names)")
    added = []
    for point, name in names:
        try:
            box = Sandbox(point, name, file=path, device=str(device), static_check=static)
        except SandboxError as e:
            unload(added)
            raise PluginError(f"loading {path} in its sandbox failed: {e}") from None
        _SANDBOXES.append(box)
        v = box.variant()
        registry.variants(point)[name] = v
        added.append(v)
    return added


def sandboxed_files() -> list[str]:
    """The files of the variants registered through a sandbox in this process, once each."""
    return list(dict.fromkeys(box.file for box in _SANDBOXES))


def sandbox_count() -> int:
    return len(_SANDBOXES)


def close_sandboxed(keep: int = 0) -> None:
    """Unregister the sandboxed variants and end their processes, all but the first `keep` started
    (`sandbox_count()` before a caller started its own)."""
    while len(_SANDBOXES) > keep:
        box = _SANDBOXES.pop()
        registry.variants(box.point).pop(box.name, None)
        box.close()


def ensure_registered(point: str, name: str, source: str | None, root: str, *, sandboxed: bool = False,
                      device="cpu") -> None:
    """Register `point:name` from `source` (a lock entry's file, relative to `root` or absolute) when it
    comes from outside the package and is not registered yet: an agent's accepted variant. `sandboxed`:
    through a sandbox on `device` (a process that verifies), else imported here (one that serves)."""
    if name in registry.variants(point) or not source:
        return
    path = source if os.path.isabs(source) else os.path.join(root, source)
    if os.path.isfile(path) and (point, name) in declared(path):
        load_sandboxed(path, device=device) if sandboxed else load_file(path)
