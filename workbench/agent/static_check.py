"""Static check of a candidate variant module: an allowlist, read from the AST before any of its code runs.

A candidate may use what kernel code needs and nothing else (`allowlist.ALLOWED`; AGENTS.md lists it):
- imports: only allowlisted modules: math, itertools, functools, operator, dataclasses, typing, enum,
  collections; torch with torch.nn, torch.nn.functional, torch.linalg, torch.fft, torch.special and a
  few torch.cuda queries; triton's jit/cdiv/... and triton.language; numpy; flashinfer; cutlass and
  cutlass.cute; cuda.bindings.driver's CUstream; quack; beam_model.functional and beam_model.config;
  `register` from workbench.registry; workbench.variants.kernels.* and the other variants' modules.
  Anything that reaches frames, the interpreter or process control (sys, os, atexit, linecache,
  inspect, gc, ctypes, signal, threading, subprocess, importlib, builtins, time, ...) is out because
  it is not listed.
- module paths: `module.a.b` is resolved through the modules' own source, read as text, never
  imported: a module it passes through to take a name must be allowlisted and the name one its
  entry allows, so `torch.sys`, `os.sys`, `beam_model.importlib`, `kernels.moe.os` and
  `math.__loader__` fail, as does a registry lookup reached through another project module. A module
  is never a value (`t = torch.cuda`), and no module's state is assigned (`F.linear = ...`).
- attributes: no dunder attributes but `ALLOWED_DUNDERS`; no frame, traceback, generator or code
  internals (`tb_frame`, `gi_frame`, `f_back`, `f_globals`, `co_*`, ...); a module reached through an
  object (`x.sys`) is refused; a private attribute only on `self`, `cls` or the candidate's own
  module-level objects.
- builtins: only `ALLOWED_BUILTINS` (and exceptions derived from Exception); getattr, hasattr,
  setattr and delattr only with a literal name, checked as the attribute access it is; no eval, exec,
  compile, __import__, open, vars, globals, locals, dir, input, breakpoint, memoryview, exit.
- the reference: no import of the point's reference (a compound's members' too), nor of its package as a
  whole, and no registry lookup (`reference`, `get`, `variants`, `bind`, ...): a candidate must
  compute, not delegate to the yardstick.
Python is too dynamic for a static check to be complete; this one keeps a candidate to the code a
kernel needs, so the known escapes fail before anything runs. The sandbox process, the gates and the
judge's re-checks are the defences that hold.
"""

from __future__ import annotations

import ast
import builtins
import functools
from dataclasses import dataclass

from workbench.agent.allowlist import (
    ALLOWED,
    ALLOWED_BUILTINS,
    ALLOWED_DUNDER_NAMES,
    ALLOWED_DUNDERS,
    BANNED_ATTRS,
    BUILTIN_WHY,
    INTERPRETER_ATTRS,
    MODULE_NAMES,
    NAME_BUILTINS,
    SUMMARY,
    Entry,
    is_project,
    why_not,
)
from workbench.agent.module_source import lookup


@dataclass
class Violation:
    line: int
    rule: str
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message} ({self.rule})"

    def to_dict(self) -> dict:
        return {"line": self.line, "rule": self.rule, "message": self.message}


def registered_points(tree: ast.AST) -> set[str]:
    return {node.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "register"
            and node.args and isinstance(node.args[0], ast.Constant)}


def check_source(source: str, point: str | None = None, filename: str = "<candidate>") -> list[Violation]:
    """Violations in a candidate's source; `point` defaults to the points it registers on."""
    try:
        tree = ast.parse(source, filename)
    except SyntaxError as e:
        return [Violation(e.lineno or 0, "syntax", f"does not parse: {e.msg}")]
    return _Checker(tree, _references({point} if point else registered_points(tree))).run()


def check_file(path: str, point: str | None = None) -> list[Violation]:
    with open(path) as f:
        return check_source(f.read(), point, path)


def _references(points) -> dict[str, str]:
    """{package: its reference function's name} for the points (and a compound's members)."""
    from workbench import registry

    refs = {}
    for p in points:
        for q in ((p, *registry.COMPOUNDS.get(p, ())) if p in registry.POINTS else ()):
            refs[f"workbench.variants.{q}"] = registry.reference(q).fn.__name__
    return refs


# ------------------------------------------------------------------------------ the allowlist, looked up

def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__") and len(name) > 4


def _private(name: str) -> bool:
    return name.startswith("_") and not _dunder(name)


@functools.lru_cache(maxsize=None)
def _entry(module: str) -> Entry | None:
    """The allowlist entry covering `module` (its own, or its nearest listed package's that allows
    submodules), or None when the module is not allowlisted."""
    if module in ALLOWED:
        return ALLOWED[module]
    parts = module.split(".")
    for i in range(len(parts) - 1, 0, -1):
        e = ALLOWED.get(".".join(parts[:i]))
        if e is not None:
            rest = parts[i:]
            ok = e.submodules and not any(_banned(e, p) for p in rest) and (e.project or not any(map(_private, rest)))
            return e if ok else None
    return None


def _banned(entry: Entry, name: str) -> str | None:
    return entry.banned.get(name) or next((why for k, why in entry.banned.items()
                                           if k.endswith("*") and name.startswith(k[:-1])), None)


# ------------------------------------------------------------------------------ scopes

class _Scope:
    def __init__(self, kind: str, parent):
        self.kind, self.parent = kind, parent
        self.bound, self.globals, self.nonlocals = set(), set(), set()


class _Scopes(ast.NodeVisitor):
    """Which names each function binds, so that a loaded name is known to be the candidate's own or to
    fall through to the builtins. Only function (and lambda, comprehension) locals count as the
    candidate's: a module- or class-level name is looked up at run time and may be the builtin yet."""

    def __init__(self, tree: ast.AST):
        self.module = self.cur = _Scope("module", None)
        self.scope_of: dict[ast.Name, _Scope] = {}
        self.class_bound: set[str] = set()  # names some class body binds
        self.visit(tree)

    def bind(self, name: str, scope=None):
        s = scope or self.cur
        if name in s.globals:
            self.module.bound.add(name)
        elif name not in s.nonlocals:
            s.bound.add(name)

    def enter(self, kind: str, fn) -> None:
        self.cur = _Scope(kind, self.cur)
        fn()
        if self.cur.kind == "class":
            self.class_bound |= self.cur.bound
        self.cur = self.cur.parent

    def visit_Name(self, node):
        self.scope_of[node] = self.cur
        if not isinstance(node.ctx, ast.Load):
            self.bind(node.id)

    def visit_Global(self, node):
        self.cur.globals.update(node.names)

    def visit_Nonlocal(self, node):
        self.cur.nonlocals.update(node.names)

    def visit_Import(self, node):
        for a in node.names:
            self.bind(a.asname or a.name.split(".")[0])

    def visit_ImportFrom(self, node):
        for a in node.names:
            self.bind(a.asname or a.name)

    def outer_args(self, args: ast.arguments):
        for d in [*args.defaults, *[d for d in args.kw_defaults if d is not None]]:
            self.visit(d)
        for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
            if a is not None and a.annotation is not None:
                self.visit(a.annotation)

    def bind_args(self, args: ast.arguments):
        for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
            if a is not None:
                self.bind(a.arg)

    def visit_FunctionDef(self, node):
        for d in node.decorator_list:
            self.visit(d)
        self.outer_args(node.args)
        if node.returns:
            self.visit(node.returns)
        self.bind(node.name)

        def body():
            self.bind_args(node.args)
            for s in node.body:
                self.visit(s)
        self.enter("function", body)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node):
        self.outer_args(node.args)
        self.enter("function", lambda: (self.bind_args(node.args), self.visit(node.body)))

    def visit_ClassDef(self, node):
        for n in [*node.decorator_list, *node.bases, *[k.value for k in node.keywords]]:
            self.visit(n)
        self.bind(node.name)
        self.enter("class", lambda: [self.visit(s) for s in node.body])

    def comprehension(self, node, parts):
        self.visit(node.generators[0].iter)

        def inner():
            for i, g in enumerate(node.generators):
                self.visit(g.target)
                if i:
                    self.visit(g.iter)
                for c in g.ifs:
                    self.visit(c)
            for p in parts:
                self.visit(p)
        self.enter("comprehension", inner)

    def visit_ListComp(self, node):
        self.comprehension(node, [node.elt])

    visit_SetComp = visit_GeneratorExp = visit_ListComp

    def visit_DictComp(self, node):
        self.comprehension(node, [node.key, node.value])

    def visit_NamedExpr(self, node):
        self.visit(node.value)
        self.scope_of[node.target] = self.cur
        s = self.cur
        while s.kind == "comprehension":
            s = s.parent
        self.bind(node.target.id, s)

    def visit_ExceptHandler(self, node):
        if node.type:
            self.visit(node.type)
        if node.name:
            self.bind(node.name)
        for s in node.body:
            self.visit(s)

    def visit_MatchAs(self, node):
        if node.name:
            self.bind(node.name)
        self.generic_visit(node)

    visit_MatchStar = visit_MatchAs

    def visit_MatchMapping(self, node):
        if node.rest:
            self.bind(node.rest)
        self.generic_visit(node)

    def local(self, node: ast.Name) -> bool:
        """Whether a loaded name is a local of its function or of an enclosing one (never the builtin)."""
        s = self.scope_of.get(node)
        if s is None or node.id in s.globals:
            return False
        while s is not None and s.kind != "module":
            if s.kind != "class" and (node.id in s.bound or node.id in s.nonlocals):
                return True
            s = s.parent
        return False


# ------------------------------------------------------------------------------ the check

class _Checker:
    def __init__(self, tree: ast.AST, refs: dict[str, str]):
        self.tree, self.refs = tree, refs
        self.out: list[Violation] = []
        self.parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        self.scopes = _Scopes(tree)
        self.aliases: dict[str, list] = {}  # local name -> [("module", module) | ("value", module, name)]

    def bad(self, node, rule: str, message: str) -> None:
        self.out.append(Violation(getattr(node, "lineno", 0), rule, message))

    def run(self) -> list[Violation]:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                self.check_import(node)
            elif isinstance(node, ast.ImportFrom):
                self.check_import_from(node)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Name):
                self.check_name(node)
            elif isinstance(node, (ast.Attribute, ast.Call)) and self.outer(node) and self.chain(node)[1]:
                self.check_chain(node)
            if isinstance(node, (ast.Attribute, ast.Subscript)) and not isinstance(node.ctx, ast.Load):
                self.check_store(node)
        seen, unique = set(), []
        for v in sorted(self.out, key=lambda v: (v.line, v.rule, v.message)):
            if (v.line, v.message) not in seen:
                seen.add((v.line, v.message))
                unique.append(v)
        return unique

    # -- imports

    def not_allowed(self, node, module: str, what: str, name: str | None = None) -> None:
        rule, hint = why_not(name or module)
        self.bad(node, rule, f"{what} ({module} is not on the allowlist{'; ' + hint if hint else ''}; "
                             f"allowed: {SUMMARY}; see AGENTS.md)")

    def import_module(self, node, module: str, what: str) -> None:
        """`module` bound whole to a name."""
        if module in self.refs:
            self.bad(node, "the reference", f"{what}: {module} holds the point's reference "
                                            f"({module}.{self.refs[module]}); import the names you use")
        elif module == "workbench.registry":
            self.bad(node, "the reference", f"{what}: only `from workbench.registry import register` "
                                            "(its lookups hand out the reference)")
        elif _entry(module) is None:
            self.not_allowed(node, module, what)

    def check_import(self, node: ast.Import) -> None:
        for a in node.names:
            self.import_module(node, a.name, f"imports {a.name}")
            top = a.name.split(".")[0]
            self.aliases.setdefault(a.asname or top, []).append(("module", a.name if a.asname else top))

    def check_import_from(self, node: ast.ImportFrom) -> None:
        if node.level:
            self.bad(node, "not allowed", "relative import: a candidate is a standalone module")
            return
        module = node.module or ""
        for a in node.names:
            local, what = a.asname or a.name, f"imports {module}.{a.name}"
            if a.name == "*":
                self.bad(node, "not allowed", f"imports * from {module}: import the names you use")
                continue
            kind, target, origin = lookup(module, a.name)
            if kind == "module":
                self.import_module(node, target, what if target == f"{module}.{a.name}" else f"{what} (= {target})")
                self.aliases.setdefault(local, []).append(("module", target))
            else:
                self.take(node, module, a.name, kind, origin, what)
                self.aliases.setdefault(local, []).append(("value", module, a.name))

    def take(self, node, module: str, name: str, kind: str, origin, what: str) -> None:
        """A name (not a module) taken from `module`: allowed by the module's entry, not the reference."""
        if self.refs.get(module) == name:
            self.bad(node, "the reference", f"{what}: the point's reference (a candidate computes, it does not "
                                            "call the yardstick)")
            return
        if module == "workbench.registry" and name != "register":
            self.bad(node, "the reference", f"{what}: only `register` (the registry's lookups hand out the reference)")
            return
        entry = _entry(module)
        if entry is None:
            self.not_allowed(node, module, what, f"{module}.{name}")
            return
        if _dunder(name):
            return  # checked as an attribute (ALLOWED_DUNDERS)
        if entry.names is not None and name not in entry.names:
            self.bad(node, why_not(f"{module}.{name}")[0],
                     f"{what}: {module} allows only {', '.join(sorted(entry.names))}")
        elif entry.names is None and _banned(entry, name):
            hint = why_not(f"{module}.{name}")[1]
            self.bad(node, _banned(entry, name), f"{what}: not on the allowlist{' (' + hint + ')' if hint else ''}")
        elif _private(name) and not entry.project and name not in entry.private:
            self.bad(node, "not allowed", f"{what}: a private name of {module}")
        elif entry.project and kind == "unknown":
            self.bad(node, "not allowed", f"{what}: {module} defines no {name}")
        elif entry.project and kind == "value" and origin and tuple(origin) != (module, name):
            # a project module's name is judged where it comes from: a registry lookup or a library name
            # re-exported through another module is what it is
            omod, oname = origin
            self.take(node, omod, oname, "value", None, f"{what} (= {omod}.{oname})")

    # -- names and attributes

    def outer(self, node) -> bool:
        """Whether `node` is the whole of an attribute chain (not the `a.b` inside `a.b.c`)."""
        parent = self.parents.get(node)
        if isinstance(parent, ast.Attribute) and parent.value is node:
            return False
        return not (isinstance(parent, ast.Call) and self.literal_name(parent) and parent.args[0] is node)

    def literal_name(self, call) -> str | None:
        """The attribute name of `getattr(x, "name")` (and hasattr, setattr, delattr), else None."""
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in NAME_BUILTINS \
                and not self.scopes.local(call.func) and len(call.args) >= 2 \
                and isinstance(call.args[1], ast.Constant) and isinstance(call.args[1].value, str):
            return call.args[1].value
        return None

    def chain(self, node) -> tuple[ast.AST, list[str]]:
        """(root expression, attribute names) of `a.b.c`, `getattr(a.b, "c")` and the like."""
        attrs = []
        while True:
            if isinstance(node, ast.Attribute):
                attrs.append(node.attr)
                node = node.value
            elif self.literal_name(node):
                attrs.append(node.args[1].value)
                node = node.args[0]
            else:
                return node, attrs[::-1]

    def module_targets(self, name: str) -> list[str]:
        return [t[1] for t in self.aliases.get(name, ()) if t[0] == "module"]

    def check_name(self, node: ast.Name) -> None:
        name = node.id
        if _dunder(name):
            if name not in ALLOWED_DUNDER_NAMES:
                self.bad(node, "reaching other objects", f"uses {name} (interpreter internals)")
            return
        if not isinstance(node.ctx, ast.Load):
            return
        if self.module_targets(name) and self.outer(node):
            for m in self.module_targets(name):
                self.module_value(node, m, name)
        if self.scopes.local(node) or not hasattr(builtins, name) or name in ALLOWED_BUILTINS:
            return
        if name in NAME_BUILTINS:
            parent = self.parents.get(node)
            if not (isinstance(parent, ast.Call) and parent.func is node and self.literal_name(parent)):
                self.bad(node, "reaching other objects", f"uses {name} with a computed name or as a value "
                                                         f"(only {name}(obj, \"literal\"))")
            return
        shadow = (f"; the module or a class binds {name} too, but such a name is the builtin until that line "
                  "runs: rename it") if name in self.scopes.module.bound or name in self.scopes.class_bound else ""
        self.bad(node, BUILTIN_WHY.get(name, "not allowed"),
                 f"uses {name}() (a builtin not on the allowlist; allowed: plain data and iteration builtins such "
                 "as len, range, min, max, isinstance, sorted, zip, exceptions derived from Exception, and "
                 f"getattr/hasattr/setattr/delattr with a literal name; see AGENTS.md{shadow})")

    def check_chain(self, node) -> None:
        root, attrs = self.chain(node)
        written = ".".join([root.id if isinstance(root, ast.Name) else ast.unparse(root)[:40], *attrs])
        for a in attrs:
            if _dunder(a) and a not in ALLOWED_DUNDERS:
                self.bad(node, "reaching other objects", f"uses {written}: the attribute {a} (dunder attributes "
                                                         f"reach interpreter internals; allowed: "
                                                         f"{', '.join(sorted(ALLOWED_DUNDERS))})")
            elif a in INTERPRETER_ATTRS or a.startswith("co_"):
                self.bad(node, "reaching other objects", f"uses {written}: {a} is frame, traceback, generator or "
                                                         "code internals")
            elif a in BANNED_ATTRS:
                self.bad(node, BANNED_ATTRS[a], f"uses {written}: .{a} is not allowed on anything")
        targets = self.aliases.get(root.id, []) if isinstance(root, ast.Name) else []
        if isinstance(node, ast.Call) and node.func.id in ("setattr", "delattr") and targets:
            self.bad(node, "shared state", f"{node.func.id} on {written}: the state of a module, or of an object "
                                           "imported from one, is not the candidate's to change")
        for t in targets:
            if t[0] == "module":
                self.walk(node, t[1], attrs, written)
        if not targets or any(t[0] != "module" for t in targets):
            self.object_attrs(node, root, attrs, written)

    def walk(self, node, module: str, attrs: list[str], written: str) -> None:
        """The path `module.attrs...`: modules it passes through, then the name it takes from the last."""
        for i, a in enumerate(attrs):
            if _dunder(a):
                return
            kind, target, origin = lookup(module, a)
            if kind == "unknown" and a in MODULE_NAMES and not is_project(module):
                kind, target = "module", a
            if kind == "module":
                module = target
                continue
            self.take(node, module, a, kind, origin, f"uses {written}")
            self.object_attrs(node, None, attrs[i + 1:], written)
            return
        self.module_value(node, module, written)

    def module_value(self, node, module: str, written: str) -> None:
        """The path ends at a module, used as a value (`x is None` / `is not None` tests aside: an optional
        import)."""
        what = f"uses {written}" + (f" (= {module})" if module != written else "")
        parent = self.parents.get(node)
        if isinstance(parent, ast.Compare) and all(isinstance(op, (ast.Is, ast.IsNot)) for op in parent.ops) \
                and all(isinstance(c, ast.Constant) and c.value is None for c in [parent.left, *parent.comparators]
                        if c is not node):
            return
        if module in self.refs or module == "workbench.registry" or _entry(module) is None:
            self.import_module(node, module, what)
        else:
            self.bad(node, "not allowed", f"{what}: a module used as a value (read its attributes where you "
                                          "use them; import a submodule under its own name)")

    def object_attrs(self, node, root, attrs: list[str], written: str) -> None:
        """Attributes of an object (not a module): no module reached through it, private ones only on the
        candidate's own objects."""
        own = isinstance(root, ast.Name) and (root.id in ("self", "cls") or (
            root.id in self.scopes.module.bound and root.id not in self.aliases)) or (
            isinstance(root, ast.Call) and isinstance(root.func, ast.Name) and root.func.id == "super")
        for a in attrs:
            if a in MODULE_NAMES:
                self.bad(node, why_not(a)[0], f"uses {written}: .{a} reaches a module through an object")
            elif _private(a) and not own:
                self.bad(node, "not allowed", f"uses {written}: {a} is a private attribute of an object the "
                                              "candidate did not make (allowed on self, cls and its own "
                                              "module-level objects)")

    def check_store(self, node) -> None:
        """No assignment into a module or into an object imported from one."""
        root = node
        while isinstance(root, (ast.Attribute, ast.Subscript)) or self.literal_name(root):
            root = root.args[0] if isinstance(root, ast.Call) else root.value
        if isinstance(root, ast.Name) and root.id in self.aliases:
            self.bad(node, "shared state", f"assigns {ast.unparse(node)[:60]}: the state of a module, or of an object "
                                           "imported from one, is not the candidate's to change")

