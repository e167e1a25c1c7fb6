"""Static check of a candidate variant module: an allowlist, read from the AST before any of its code runs.

A candidate may use what kernel code needs and nothing else (`ALLOWED` below; AGENTS.md lists it):
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
import importlib.machinery
import importlib.util
import os
from dataclasses import dataclass, field


@dataclass
class Entry:
    """What a candidate may take from one allowlisted module."""
    names: frozenset | None = None  # only these names; None: every public name it has
    banned: dict = field(default_factory=dict)  # name (or "prefix*") -> why; also bans submodules of that name
    private: frozenset = frozenset()  # private names allowed all the same
    submodules: bool = False  # its submodules are allowlisted too, under this entry
    project: bool = False  # a module of this repository: every name it defines, private ones included


def _only(*names: str) -> Entry:
    return Entry(names=frozenset(names))


def _public(banned: dict | None = None, private=(), submodules: bool = False) -> Entry:
    return Entry(banned=banned or {}, private=frozenset(private), submodules=submodules)


STRING_LOOKUP = "reaching other objects"
ALLOWED: dict[str, Entry] = {
    "__future__": _only("annotations"),
    "math": _public(),
    "itertools": _public(),
    "functools": _only("partial", "partialmethod", "reduce", "lru_cache", "cache", "cached_property", "wraps",
                       "update_wrapper", "total_ordering", "cmp_to_key", "singledispatch", "singledispatchmethod"),
    "operator": _public({"attrgetter": STRING_LOOKUP, "methodcaller": STRING_LOOKUP}),
    "dataclasses": _only("dataclass", "field", "fields", "replace", "asdict", "astuple", "is_dataclass",
                         "InitVar", "KW_ONLY", "MISSING", "FrozenInstanceError"),
    "typing": _only("Any", "Annotated", "Callable", "ClassVar", "Dict", "Final", "FrozenSet", "Generic", "Iterable",
                    "Iterator", "List", "Literal", "Mapping", "NamedTuple", "NoReturn", "Optional", "Protocol",
                    "Sequence", "Set", "Tuple", "Type", "TypeAlias", "TypeVar", "TypedDict", "Union", "cast",
                    "overload", "TYPE_CHECKING"),
    "enum": _only("Enum", "IntEnum", "Flag", "IntFlag", "StrEnum", "auto", "unique"),
    "collections": _only("namedtuple", "deque", "defaultdict", "OrderedDict", "Counter", "ChainMap"),
    # torch: its flat namespace of ops, less what touches files, processes, timing, streams or global
    # state; submodules only where listed.
    "torch": _public({"load": "file access", "save": "file access", "from_file": "file access",
                      "compile": "processes", "Event": "timing", "Stream": "extra CUDA streams",
                      "classes": "native code", "cpp": "native code", "get_device_module": STRING_LOOKUP,
                      "manual_seed": "global state", "seed": "global state", "set_*": "global state",
                      "use_deterministic_algorithms": "global state"},
                     private=("_grouped_mm", "_scaled_mm", "_scaled_grouped_mm", "_int_mm")),
    "torch.nn": _public({"parallel": "threads", "register_module_*": "global state"}, submodules=True),
    "torch.nn.functional": _public(),
    "torch.linalg": _public(),
    "torch.fft": _public(),
    "torch.special": _public(),
    "torch.version": _public(),
    "torch.cuda": _only("is_available", "device_count", "current_device", "get_device_properties",
                        "get_device_capability", "get_device_name", "current_stream", "default_stream",
                        "synchronize", "device", "is_bf16_supported", "OutOfMemoryError"),
    "triton": _only("jit", "cdiv", "next_power_of_2", "Config", "heuristics", "constexpr", "reinterpret",
                    "TensorWrapper", "language"),
    "triton.language": _public({"globaltimer": "timing", "ir": "native code"}, submodules=True),
    "numpy": _public({"load": "file access", "save": "file access", "savez": "file access",
                      "savez_compressed": "file access", "savetxt": "file access", "loadtxt": "file access",
                      "genfromtxt": "file access", "fromfile": "file access", "fromregex": "file access",
                      "memmap": "file access", "DataSource": "file access", "set_printoptions": "global state",
                      "seterr": "global state", "seterrcall": "global state", "setbufsize": "global state"}),
    "numpy.linalg": _public(),
    "numpy.fft": _public(),
    "flashinfer": _public({"jit": "native code", "aot": "native code", "artifacts": "network",
                           "autotuner": "timing", "autotune": "timing", "testing": "timing",
                           "profiler": "profiling", "comm": "processes"}, submodules=True),
    "cutlass": _public({"testing": "timing"}, submodules=True),
    "cuda.bindings.driver": _only("CUstream"),
    "quack": _public({"autotuner": "timing", "autotune": "timing", "testing": "timing"}, submodules=True),
    "beam_model.functional": Entry(project=True),
    "beam_model.config": Entry(project=True),
    "workbench.registry": _only("register"),
    # kernels/ and every point package and variant module; the point's own reference is refused apart
    "workbench.variants": Entry(project=True, submodules=True, banned={"inputs": "the harness"}),
}
SUMMARY = ("math, itertools, functools, operator, dataclasses, typing, enum, collections, torch (nn, "
           "nn.functional, linalg, fft, special, a few torch.cuda queries), triton (jit, cdiv, ...), "
           "triton.language, numpy, flashinfer, cutlass, cutlass.cute, cuda.bindings.driver.CUstream, quack, "
           "beam_model.functional, beam_model.config, workbench.registry.register, workbench.variants.kernels.* "
           "and other variants' modules")
PROJECT = ("workbench", "beam_model", "server")  # this repository's packages, read name by name

# Why a module or name is not on the allowlist (longest prefix wins), for the messages and their rule;
# the allowlist decides, these only explain. Anything unlisted is "not allowed".
WHY = {
    "time": "timing", "timeit": "timing", "torch.cuda.Event": "timing", "torch.Event": "timing",
    "triton.autotune": "timing", "triton.testing": "timing",
    "cProfile": "profiling", "profile": "profiling", "pstats": "profiling", "tracemalloc": "profiling",
    "torch.profiler": "profiling", "torch.autograd.profiler": "profiling", "torch.cuda.nvtx": "profiling",
    "threading": "threads", "_thread": "threads", "concurrent": "threads", "asyncio": "threads",
    "multiprocessing": "processes", "subprocess": "processes", "pty": "processes",
    "os": "processes and files", "os.system": "processes", "os.popen": "processes", "os.fork": "processes",
    "os.exec*": "processes", "os.spawn*": "processes", "os.posix_spawn*": "processes", "os._exit": "processes",
    "os.kill": "signals", "torch.multiprocessing": "processes", "torch.distributed": "processes",
    "torch.compile": "processes",
    "signal": "signals", "faulthandler": "signals", "atexit": "code at exit",
    "socket": "network", "ssl": "network", "urllib": "network", "http": "network", "requests": "network",
    "torch.hub": "network",
    "pathlib": "file access", "io": "file access", "shutil": "file access", "tempfile": "file access",
    "glob": "file access", "pickle": "file access", "shelve": "file access", "linecache": "file access",
    "os.open": "file access", "os.read": "file access", "os.listdir": "file access", "os.remove": "file access",
    "torch.load": "file access", "torch.save": "file access", "torch.serialization": "file access",
    "torch.jit": "file access",
    "sys": "reaching other objects", "gc": "reaching other objects", "inspect": "reaching other objects",
    "traceback": "reaching other objects", "types": "reaching other objects",
    "importlib": "dynamic import", "builtins": "dynamic import", "runpy": "dynamic import",
    "pkgutil": "dynamic import", "code": "dynamic code", "codeop": "dynamic code", "marshal": "dynamic code",
    "ctypes": "raw memory access", "mmap": "raw memory access", "numpy.lib": "raw memory access",
    "numpy.ctypeslib": "raw memory access",
    "torch.cuda.Stream": "extra CUDA streams", "torch.cuda.ExternalStream": "extra CUDA streams",
    "torch.cuda.stream": "extra CUDA streams", "torch.cuda.set_stream": "extra CUDA streams",
    "torch.Stream": "extra CUDA streams", "torch.cuda.graph": "CUDA graphs", "torch.cuda.CUDAGraph": "CUDA graphs",
    "torch.cuda.make_graphed_callables": "CUDA graphs",
    "torch.cuda.is_current_stream_capturing": "detecting the harness",
    "torch.utils.deterministic": "detecting the harness",
    "torch.utils.cpp_extension": "native code", "torch.library": "native code", "torch.ops.load_library": "native code",
    "triton.runtime": "native code", "triton.compiler": "native code",
    "torch.backends": "global state", "torch.random": "global state", "torch.cuda.set_*": "global state",
    "torch.cuda.manual_seed": "global state",
    "workbench": "the harness", "workbench.registry": "the reference", "beam_model": "the harness",
    "server": "the harness",
}
HINTS = {  # what to use instead
    "os": "whether Triton runs interpreted: workbench.variants.kernels.triton_common.INTERPRETED",
    "torch.distributed": "the all-reduce: workbench.variants.kernels.tensor_parallel.all_reduced",
    "torch.compile": "write the fused kernel (every point's torch_compile variant is timed already)",
    "triton.autotune": "tuning configs go in register(..., configs=[...]); the search times them",
    "time": "timing is the harness's", "beam_model": "beam_model.functional and beam_model.config",
}

ALLOWED_DUNDERS = frozenset({"__name__", "__qualname__", "__doc__", "__version__", "__init__", "__call__", "__len__"})
ALLOWED_DUNDER_NAMES = frozenset({"__name__", "__doc__", "__all__", "__slots__"})  # bare names
# Frame, traceback, generator, coroutine, code and cell internals (and any `co_*`): the way to callers'
# locals and globals, whatever object they hang off.
INTERPRETER_ATTRS = frozenset({
    "f_back", "f_builtins", "f_code", "f_globals", "f_locals", "f_lasti", "f_lineno", "f_trace",
    "f_trace_lines", "f_trace_opcodes", "tb_frame", "tb_next", "tb_lasti", "tb_lineno",
    "gi_frame", "gi_code", "gi_running", "gi_yieldfrom", "gi_suspended", "cr_frame", "cr_code", "cr_await",
    "cr_running", "cr_origin", "cr_suspended", "ag_frame", "ag_code", "ag_await", "ag_running",
    "cell_contents", "func_globals", "func_code", "im_func", "im_self",
})
# Module names that are never an attribute a candidate reads, on a module (where the source cannot say
# what it is) or on any object.
MODULE_NAMES = frozenset({
    "sys", "os", "posix", "nt", "builtins", "importlib", "subprocess", "ctypes", "_ctypes", "gc", "inspect",
    "linecache", "atexit", "signal", "faulthandler", "threading", "_thread", "multiprocessing", "concurrent",
    "asyncio", "socket", "ssl", "urllib", "http", "requests", "shutil", "pathlib", "tempfile", "io", "_io",
    "pickle", "marshal", "traceback", "types", "runpy", "pkgutil", "pty", "mmap", "resource", "time", "timeit",
    "cProfile", "profile", "tracemalloc", "sysconfig", "site", "pdb", "bdb", "fcntl", *PROJECT,
})
# Attribute names refused on anything: they open files, load native code, import, or replace torch's own
# kernels for the whole process (an op overload's Python kernels).
BANNED_ATTRS = {
    "from_file": "file access", "tofile": "file access", "dump": "file access", "share_memory_": "file access",
    "load_library": "native code", "load_module": "native code", "exec_module": "dynamic import",
    "import_module": "dynamic import", "py_impl": "native code", "py_kernels": "native code",
}
_EXC = frozenset(n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, Exception))
ALLOWED_BUILTINS = frozenset({
    "abs", "all", "any", "ascii", "bin", "bool", "bytearray", "bytes", "callable", "chr", "classmethod",
    "complex", "dict", "divmod", "enumerate", "filter", "float", "format", "frozenset", "hash", "hex", "id",
    "int", "isinstance", "issubclass", "iter", "len", "list", "map", "max", "min", "next", "object", "oct",
    "ord", "pow", "print", "property", "range", "repr", "reversed", "round", "set", "slice", "sorted",
    "staticmethod", "str", "sum", "super", "tuple", "type", "zip", "Ellipsis", "NotImplemented",
}) | _EXC
NAME_BUILTINS = frozenset({"getattr", "hasattr", "setattr", "delattr"})  # a literal name only
BUILTIN_WHY = {
    "eval": "dynamic code", "exec": "dynamic code", "compile": "dynamic code", "__import__": "dynamic import",
    "open": "file access", "input": "reading stdin", "breakpoint": "debugger", "help": "debugger",
    "vars": "reaching other objects", "globals": "reaching other objects", "locals": "reaching other objects",
    "dir": "reaching other objects", "memoryview": "raw memory access", "exit": "process control",
    "quit": "process control", "BaseException": "process control", "SystemExit": "process control",
    "KeyboardInterrupt": "process control", "GeneratorExit": "process control",
}


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


def _project(module: str) -> bool:
    return module.split(".")[0] in PROJECT


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


def _why(name: str) -> tuple[str, str]:
    """(the rule, a hint of what to use instead) for a module or dotted name left off the allowlist:
    the longest listed prefix's ("os.exec*" matches any name starting "os.exec")."""
    parts, rule, hint = name.split("."), None, None
    for i in range(len(parts), 0, -1):
        p = ".".join(parts[:i])
        rule = rule or WHY.get(p) or next((w for k, w in WHY.items() if k.endswith("*") and p.startswith(k[:-1])), None)
        hint = hint or HINTS.get(p)
    return rule or "not allowed", hint or ""


# ------------------------------------------------------------------------------ modules, read as source

@functools.lru_cache(maxsize=None)
def _spec(module: str):
    """The module's import spec, found without running any module code; None if there is no such module."""
    parent, _, _ = module.rpartition(".")
    try:
        if not parent:
            return importlib.util.find_spec(module)
        p = _spec(parent)
        if p is None or not p.submodule_search_locations:
            return None
        return importlib.machinery.PathFinder.find_spec(module, list(p.submodule_search_locations))
    except (ImportError, ValueError, AttributeError):
        return None


@functools.lru_cache(maxsize=None)
def _bindings(module: str):
    """({name: [how the module's top level binds it]}, [modules it star-imports]) from its source, or
    None where there is no Python source (a builtin or extension module, or not installed)."""
    spec = _spec(module)
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
def _lookup(module: str, attr: str) -> tuple[str, str | None, tuple | None]:
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
        return ("module", sub, None) if _spec(sub) is not None else ("unknown", None, None)
    binds, stars = found
    value = None
    for how in binds.get(attr, ()):
        if how[0] == "module":
            return "module", how[1], None
        if how[0] == "from":
            src, name = how[1], how[2]
            if _spec(f"{src}.{name}") is not None:
                return "module", f"{src}.{name}", None
            kind, target, origin = _lookup(src, name)
            if kind == "module":
                return kind, target, None
            if value is None:
                value = origin if kind == "value" and (_project(src) or not _project(module)) else (src, name)
        elif value is None:
            value = (module, attr)
    if value is not None:
        return "value", None, value
    for star in stars:
        got = _lookup(star, attr)
        if got[0] != "unknown":
            return got
    return ("module", sub, None) if _spec(sub) is not None else ("unknown", None, None)


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
        rule, hint = _why(name or module)
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
            kind, target, origin = _lookup(module, a.name)
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
            self.bad(node, _why(f"{module}.{name}")[0],
                     f"{what}: {module} allows only {', '.join(sorted(entry.names))}")
        elif entry.names is None and _banned(entry, name):
            hint = _why(f"{module}.{name}")[1]
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
            kind, target, origin = _lookup(module, a)
            if kind == "unknown" and a in MODULE_NAMES and not _project(module):
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
                self.bad(node, _why(a)[0], f"uses {written}: .{a} reaches a module through an object")
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

