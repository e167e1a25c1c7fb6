"""What a dotted name in a candidate is, found from the modules' source read as text, never by importing
them: `spec_of(module)` (its import spec) and `lookup(module, attr)` (a submodule, or a value and where
it comes from). The static check walks `a.b.c` with it, so a module reached through another's globals
(`torch.sys`, `kernels.moe.os`) is seen for what it is.
"""

from __future__ import annotations

import ast
import functools
import importlib.machinery
import importlib.util
import os

from workbench.agent.allowlist import is_project


@functools.lru_cache(maxsize=None)
def spec_of(module: str):
    """The module's import spec, found without running any module code; None if there is no such module."""
    parent, _, _ = module.rpartition(".")
    try:
        if not parent:
            return importlib.util.find_spec(module)
        p = spec_of(parent)
        if p is None or not p.submodule_search_locations:
            return None
        return importlib.machinery.PathFinder.find_spec(module, list(p.submodule_search_locations))
    except (ImportError, ValueError, AttributeError):
        return None


@functools.lru_cache(maxsize=None)
def _bindings(module: str):
    """({name: [how the module's top level binds it]}, [modules it star-imports]) from its source, or
    None where there is no Python source (a builtin or extension module, or not installed)."""
    spec = spec_of(module)
    origin = getattr(spec, "origin", None) or ""
    if not origin.endswith(".py") or not os.path.isfile(origin):
        return None
    try:
        with open(origin, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    package = module if spec.submodule_search_locations is not None else module.rpartition(".")[0]
    binds: dict[str, list] = {}
    stars: list[str] = []

    def add(name, how):
        binds.setdefault(name, []).append(how)

    def targets(t):
        for n in ast.walk(t):
            if isinstance(n, ast.Name):
                add(n.id, ("value",))

    def visit(stmts):
        for s in stmts:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                add(s.name, ("value",))
            elif isinstance(s, ast.Import):
                for a in s.names:
                    top = a.name.split(".")[0]
                    add(a.asname or top, ("module", a.name if a.asname else top))
            elif isinstance(s, ast.ImportFrom):
                base = package
                for _ in range(max(s.level - 1, 0)):
                    base = base.rpartition(".")[0]
                src = (f"{base}.{s.module}" if s.module else base) if s.level else (s.module or "")
                for a in s.names:
                    if a.name == "*":
                        stars.append(src)
                    else:
                        add(a.asname or a.name, ("from", src, a.name))
            elif isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in (s.targets if isinstance(s, ast.Assign) else [s.target]):
                    targets(t)
            elif isinstance(s, (ast.For, ast.AsyncFor, ast.With, ast.AsyncWith)):
                for t in ([s.target] if isinstance(s, (ast.For, ast.AsyncFor)) else
                          [i.optional_vars for i in s.items if i.optional_vars]):
                    targets(t)
            for block in ("body", "orelse", "finalbody"):
                if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(getattr(s, block, None) or [])
            for h in getattr(s, "handlers", None) or []:
                visit(h.body)

    visit(tree.body)
    return binds, stars


_ACTIVE: set = set()


@functools.lru_cache(maxsize=None)
def lookup(module: str, attr: str) -> tuple[str, str | None, tuple | None]:
    """What `module.attr` is, from source: ("module", that module's name, None), ("value", None,
    (module, name) it comes from: for project code, where it is defined or the library it is taken from),
    or ("unknown", None, None) where the source does not say (names made at run time, no source)."""
    if (module, attr) in _ACTIVE:
        return "unknown", None, None
    _ACTIVE.add((module, attr))
    try:
        return _lookup_source(module, attr)
    finally:
        _ACTIVE.discard((module, attr))


def _lookup_source(module: str, attr: str):
    sub = f"{module}.{attr}"
    found = _bindings(module)
    if found is None:
        return ("module", sub, None) if spec_of(sub) is not None else ("unknown", None, None)
    binds, stars = found
    value = None
    for how in binds.get(attr, ()):
        if how[0] == "module":
            return "module", how[1], None
        if how[0] == "from":
            src, name = how[1], how[2]
            if spec_of(f"{src}.{name}") is not None:
                return "module", f"{src}.{name}", None
            kind, target, origin = lookup(src, name)
            if kind == "module":
                return kind, target, None
            if value is None:
                value = origin if kind == "value" and (is_project(src) or not is_project(module)) else (src, name)
        elif value is None:
            value = (module, attr)
    if value is not None:
        return "value", None, value
    for star in stars:
        got = lookup(star, attr)
        if got[0] != "unknown":
            return got
    return ("module", sub, None) if spec_of(sub) is not None else ("unknown", None, None)
