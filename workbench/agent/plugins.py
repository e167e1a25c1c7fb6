"""Variant modules from outside the package (`--dir DIR`, `BEAM_WORKBENCH_PLUGINS`), registered the
same way as the package's own: the module calls `workbench.registry.register`.

A plugin module is any `*.py` in the directory not starting with `_`. Before it is imported it must
pass the static check, and every point it registers on is loaded first, so a name it shares with
an existing variant is caught as a clash (an error naming both files) and never shadows one.
Importing a plugin runs its code: the CLI does that only inside an isolated worker
(`workbench.agent.worker`). A process that judges, times or locks (`workbench optimize`, `workbench lock
verify`) never imports a candidate: `workbench.agent.candidates` registers it through a sandbox.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import sys

from workbench import registry

MODULE_PREFIX = "workbench_plugins."  # plugin modules are imported under this package name
ENV = "BEAM_WORKBENCH_PLUGINS"  # os.pathsep-separated plugin directories, added to every --dir


class PluginError(ValueError):
    """A plugin module that cannot be loaded: banned code, a name clash, or an import error."""


def plugin_dirs(given=None) -> list[str]:
    """The --dir directories, then those of $BEAM_WORKBENCH_PLUGINS, as absolute paths, once each."""
    dirs = list(given or []) + [d for d in os.environ.get(ENV, "").split(os.pathsep) if d]
    return list(dict.fromkeys(os.path.abspath(d) for d in dirs))


def module_files(directory: str) -> list[str]:
    if not os.path.isdir(directory):
        raise PluginError(f"plugin directory {directory} does not exist")
    return sorted(os.path.join(directory, f) for f in os.listdir(directory)
                  if f.endswith(".py") and not f.startswith("_"))


def declared(path: str) -> list[tuple[str, str]]:
    """(point, name) of each `register("point", "name", ...)` call written with literal arguments."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "register" \
                and len(node.args) >= 2 and all(isinstance(a, ast.Constant) for a in node.args[:2]):
            out.append((node.args[0].value, node.args[1].value))
    return out


def free_names(path: str) -> list[tuple[str, str]]:
    """`declared(path)`, each on a known point and not registered yet (the point's own module is
    loaded first, so a clash names both files); raises PluginError otherwise."""
    names = declared(path)
    for point, name in names:
        if point not in registry.POINTS:
            raise PluginError(f"{path} registers on unknown fusion point {point!r}")
        existing = registry.variants(point).get(name)
        if existing is not None:
            raise PluginError(f"{path} registers {point}:{name}, which {existing.source_file} already "
                              "registers: rename the variant")
    return names


def load_file(path: str, *, static: bool = True) -> list[registry.Variant]:
    """Import one plugin module; returns the variants it registered. Raises PluginError."""
    from workbench.agent.static_check import check_file

    path = os.path.abspath(path)
    if static:
        violations = check_file(path)
        if violations:
            raise PluginError(f"{path} fails the static check: " + "; ".join(str(v) for v in violations))
    names = free_names(path)
    before = {p: set(registry.variants(p)) for p in {p for p, _ in names} or registry.POINTS}
    module_name = f"{MODULE_PREFIX}m{hashlib.sha256(path.encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        _forget(before)
        sys.modules.pop(module_name, None)
        raise PluginError(f"importing {path} failed: {type(e).__name__}: {e}") from e
    added = [registry.variants(p)[n] for p, known in before.items() for n in registry.variants(p) if n not in known]
    if not added:
        raise PluginError(f"{path} registers no variant (use @register(POINT, NAME, BACKEND) with literal names)")
    return added


def _forget(before: dict[str, set]) -> None:
    for point, known in before.items():
        for name in [n for n in registry.variants(point) if n not in known]:
            del registry.variants(point)[name]


def unload(found: list[registry.Variant]) -> None:
    """Remove plugin variants from the registry (tests, and a judge that loaded a candidate)."""
    for v in found:
        registry.variants(v.point).pop(v.name, None)


def load_dirs(dirs) -> list[registry.Variant]:
    """Every plugin module of every directory; the first failure raises."""
    return [v for d in plugin_dirs(dirs) for path in module_files(d) for v in load_file(path)]


def plugin_file(variant: registry.Variant) -> str | None:
    """The file a variant was loaded from when it came from outside the package (a process that
    needs it, such as the judge's worker, must load that file), else None."""
    if variant.origin:
        return variant.origin
    return variant.source_file if getattr(variant.fn, "__module__", "").startswith(MODULE_PREFIX) else None


def imported_files() -> list[str]:
    """The files of the registered variants this process imported (`load_file`, e.g. `--dir`), once each."""
    return list(dict.fromkeys(f for p in registry.POINTS for v in registry.variants(p).values()
                              if not v.origin and (f := plugin_file(v))))
