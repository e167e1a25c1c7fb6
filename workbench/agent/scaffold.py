"""`workbench variant new`: a variant module that starts as an exact copy of the point's reference.

The module holds the point's contract (its module docstring), the shapes the target calls it with,
the reference function's source inlined without comments or docstrings (and the module-level
helpers and imports it uses, so it never calls the reference), and the `@register` line. As
written it passes `workbench check NAME`; the author then replaces the body. This module only
writes the new file: it never edits an existing variant.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import os
import re
import textwrap

from workbench import registry
from workbench.code_text import docstring

BACKENDS = ("torch", "triton", "cute")
PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "variants")
_KERNEL_NOTE = {
    "triton": "Where the kernel goes: define `@triton.jit` kernels in this module (`from "
              "workbench.variants.kernels.triton_common import round_to, tl, triton`) and launch them from the "
              "function below in place of the torch ops, allocating outputs with torch.empty (the gates "
              "poison unwritten memory). `workbench/variants/boundary/triton.py` holds a complete example.",
    "cute": "Where the kernel goes: write the CuTe DSL kernel (`import cutlass`) in this module and call it "
            "from the function below in place of the torch ops.",
    "torch": "Replace the body with a faster composition of torch ops (fewer kernels, less memory traffic).",
}


def file_name(point: str, name: str) -> str:
    return f"{point}__{name}.py"


def check_name(name: str) -> None:
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or "__" in name:
        raise ValueError(f"variant name {name!r}: use lower_snake_case (letters, digits, single underscores)")


def shapes_text(point: str, workloads: dict) -> str:
    """One line per input tensor of each workload (`{kind: Workload}`), from the point's spec, built
    on fake tensors so a full-size preset costs no memory."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from workbench.points import named_leaves, spec

    lines = []
    for kind, wl in workloads.items():
        try:
            with FakeTensorMode():
                call = spec(point).make_inputs(wl, "cpu", 0)
            leaves = named_leaves(call)
        except Exception as e:  # a spec the fake mode cannot run: say so rather than guess
            lines.append(f"{kind}: ({wl.label()}) inputs not derivable here: {type(e).__name__}")
            continue
        lines.append(f"{kind} layers ({wl.label()}):")
        lines += [f"  {n} {list(t.shape)} {str(t.dtype).replace('torch.', '')}" for n, t in leaves
                  if isinstance(t, torch.Tensor)]
    return "\n".join(lines)


def _free_names(node: ast.AST) -> set[str]:
    """Names a function or statement reads that it does not bind itself."""
    bound, used = set(), set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            (used if isinstance(n.ctx, ast.Load) else bound).add(n.id)
        elif isinstance(n, ast.arg):
            bound.add(n.arg)
        elif isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n is not node:
            bound.add(n.name)
    return used - bound - set(dir(builtins))


def _strip_docstrings(node: ast.AST) -> ast.AST:
    for n in ast.walk(node):
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and docstring(n) is not None:
            n.body = n.body[1:] or [ast.Pass()]
    return node


def reference_source(point: str, fn_name: str) -> tuple[list[str], list[str], str]:
    """(import lines, helper definitions, the function) for an inlined copy of the point's reference."""
    if point in registry.COMPOUNDS:
        return _compound_source(point, fn_name)
    ref = registry.reference(point).fn
    module = importlib.import_module(ref.__module__)
    tree = ast.parse(inspect.getsource(module))
    top: dict[str, ast.stmt] = {}
    imports: dict[str, str] = {}
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.ClassDef)):
            top[stmt.name] = stmt
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]):
                if isinstance(t, ast.Name):
                    top[t.id] = stmt
        elif isinstance(stmt, ast.Import):
            for a in stmt.names:
                imports[a.asname or a.name.split(".")[0]] = \
                    f"import {a.name}" + (f" as {a.asname}" if a.asname else "")
        elif isinstance(stmt, ast.ImportFrom) and not stmt.level:
            for a in stmt.names:
                imports[a.asname or a.name] = \
                    f"from {stmt.module} import {a.name}" + (f" as {a.asname}" if a.asname else "")
    fn = next(s for s in tree.body if isinstance(s, ast.FunctionDef) and s.name == ref.__name__)
    needed_imports, needed_defs, todo = set(), set(), list(_free_names(fn))
    while todo:
        name = todo.pop()
        if name in imports:
            needed_imports.add(name)
        elif name in top and name not in needed_defs and name != ref.__name__:
            needed_defs.add(name)
            todo += _free_names(top[name])
    fn.decorator_list = []
    fn.name = fn_name
    _strip_docstrings(fn)
    helpers = [ast.unparse(_strip_docstrings(s)) for s in tree.body if any(top.get(n) is s for n in needed_defs)]
    lines = sorted({imports[n] for n in needed_imports})
    return lines, list(dict.fromkeys(helpers)), ast.unparse(fn)


def _compound_source(point: str, fn_name: str) -> tuple[list[str], list[str], str]:
    """A compound's reference inlined: each member's reference as a helper `_<member>`, and the
    compound's split calling them in place of `ops.<member>`."""
    imports, helpers = [], []
    for member in registry.COMPOUNDS[point]:
        member_imports, member_helpers, member_fn = reference_source(member, f"_{member}")
        imports += member_imports
        helpers += member_helpers + [member_fn]
    fn = ast.parse(textwrap.dedent(inspect.getsource(registry.split_of(point)))).body[0]
    ops = fn.args.args.pop(0).arg
    for node in ast.walk(fn):
        for field_name, value in ast.iter_fields(node):
            if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.value.id == ops:
                setattr(node, field_name, ast.Name(f"_{value.attr}", ast.Load()))
    fn.decorator_list = []
    fn.name = fn_name
    _strip_docstrings(fn)
    return sorted(set(imports)), list(dict.fromkeys(helpers)), ast.unparse(ast.fix_missing_locations(fn))


def render(point: str, name: str, backend: str, shapes: str = "", *, fn_name: str | None = None) -> str:
    """The new module's source."""
    check_name(name)
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    fn_name = fn_name or f"{point}_{name}"
    contract = inspect.getdoc(importlib.import_module(f"workbench.variants.{point}")) or ""
    imports, helpers, body = reference_source(point, fn_name)
    imports = sorted(set(imports) | {"from workbench.registry import register"},
                     key=lambda s: (not s.startswith("import "), s.split()[1]))
    intro = (f"As written it is the reference computation inlined (it never calls the reference), so "
             f"`workbench check {name}` passes at once. {_KERNEL_NOTE[backend]}")
    doc = [f"`{point}` variant `{name}` ({backend}), scaffolded by `workbench variant new` from the reference.",
           "", textwrap.fill(intro, 100),
           "", f"Contract (from workbench/variants/{point}/__init__.py):", "", textwrap.indent(contract, "    ")]
    if shapes:
        doc += ["", "Shapes the target calls it with:", "", textwrap.indent(shapes, "    ")]
    parts = ['"""' + "\n".join(doc).replace('"""', "'''").rstrip() + '\n"""', "\n".join(imports)]
    parts += helpers
    parts.append(f'@register("{point}", "{name}", "{backend}")\n{body}')
    return "\n\n\n".join(p for p in parts if p) + "\n"


def write(point: str, name: str, backend: str, *, directory: str | None = None, shapes: str = "",
          force: bool = False) -> str:
    """Write the scaffold to plugin `directory`, or into the point's package; returns its path."""
    if point not in registry.POINTS:
        raise KeyError(f"unknown fusion point {point!r}; points: {', '.join(registry.POINTS)}")
    check_name(name)
    if name in registry.variants(point):
        raise ValueError(f"{point}:{name} is already registered ({registry.get(point, name).source_file})")
    # In the package a variant is `<point>/<name>.py`; a plugin directory is flat: `<point>__<name>.py`.
    path = os.path.join(os.path.abspath(directory), file_name(point, name)) if directory \
        else os.path.join(PACKAGE_DIR, point, f"{name}.py")
    directory = os.path.dirname(path)
    if os.path.exists(path) and not force:
        raise ValueError(f"{path} exists (use --force to overwrite)")
    source = render(point, name, backend, shapes)
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        f.write(source)
    return path
