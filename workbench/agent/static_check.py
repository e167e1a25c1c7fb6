"""Static check of a candidate variant module: reject banned tricks before any of its code runs.

Read from the AST only, never by importing. Banned, each reported with its line:
- the point's reference: importing it, its module as a whole, or the registry's lookups
  (`reference`, `get`, `variants`, `bind`): a candidate must compute, not delegate to the yardstick;
- timing and profiling: `time`, `timeit`, `torch.profiler`, CUDA events, `sys.settrace`, and the
  workbench's own harness (`workbench.bench`, `.gates`, `.search`, ...);
- concurrency: threads, processes, signals, extra CUDA streams or graphs;
- files and network: `open`, `pathlib`, `io`, `socket`, `urllib`, `torch.load`, ...;
- escapes around all of the above: `eval`, `exec`, `__import__`, `importlib`, `ctypes`, `gc`,
  `inspect`, dunder attributes such as `__globals__`.
A static check cannot be complete (Python is too dynamic for that); it stops the obvious tricks
cheaply. The isolated worker, the gates and the judge's re-checks are the defences that hold.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

# module (or a prefix of it) -> why it is banned
BANNED_MODULES = {
    "time": "timing", "timeit": "timing", "cProfile": "profiling", "profile": "profiling",
    "pstats": "profiling", "tracemalloc": "profiling", "torch.profiler": "profiling",
    "torch.autograd.profiler": "profiling", "torch.cuda.nvtx": "profiling",
    "threading": "threads", "_thread": "threads", "concurrent": "threads", "asyncio": "threads",
    "multiprocessing": "processes", "torch.multiprocessing": "processes", "subprocess": "processes",
    "signal": "signals",
    "socket": "network", "ssl": "network", "urllib": "network", "http": "network", "requests": "network",
    "ftplib": "network", "smtplib": "network",
    "pathlib": "file access", "io": "file access", "shutil": "file access", "tempfile": "file access",
    "glob": "file access", "pickle": "file access", "shelve": "file access", "mmap": "file access",
    "importlib": "dynamic import", "builtins": "dynamic import", "ctypes": "raw memory access",
    "gc": "reaching other objects", "inspect": "reaching other objects",
    "workbench.bench": "the timing harness", "workbench.gates": "the gates", "workbench.search": "the search",
    "workbench.optimize": "the optimize loop", "workbench.agent": "the judge", "workbench.lock": "lock files",
    "workbench.profiler": "profiling", "workbench.targets": "the timing harness",
    "workbench.commands": "the CLI",
    "workbench.timing": "the timing harness", "workbench.roofline": "the timing harness",
    "workbench.noise": "the timing harness", "workbench.bench_report": "the timing harness",
    "workbench.end_to_end": "the search", "workbench.inflight": "the search", "workbench.search_results": "the search",
    "workbench.compile_baseline": "the optimize loop", "workbench.preflight": "the optimize loop",
    "workbench.report": "the optimize loop", "workbench.events": "the optimize loop",
    "workbench.progress": "the optimize loop", "workbench.run_folder": "file access",
    "workbench.provenance": "processes",
}
# fully qualified attribute (or a prefix of it) -> why
BANNED_NAMES = {
    "torch.cuda.Event": "timing", "torch.Event": "timing", "torch.cuda.Stream": "extra CUDA streams",
    "torch.cuda.ExternalStream": "extra CUDA streams", "torch.cuda.stream": "extra CUDA streams",
    "torch.cuda.set_stream": "extra CUDA streams", "torch.Stream": "extra CUDA streams",
    "torch.cuda.graph": "CUDA graphs", "torch.cuda.CUDAGraph": "CUDA graphs",
    "torch.cuda.is_current_stream_capturing": "detecting the harness",
    "torch.load": "file access", "torch.save": "file access", "torch.from_file": "file access",
    "numpy.load": "file access", "numpy.save": "file access", "numpy.fromfile": "file access",
    "numpy.memmap": "file access", "numpy.loadtxt": "file access",
    "os.system": "processes", "os.popen": "processes", "os.fork": "processes", "os.kill": "signals",
    "os.open": "file access", "os.read": "file access", "os.listdir": "file access", "os.scandir": "file access",
    "os.walk": "file access", "os.remove": "file access", "os.unlink": "file access",
    "sys.settrace": "profiling", "sys.setprofile": "profiling", "sys._getframe": "reaching other objects",
    "sys.modules": "reaching other objects",
}
BANNED_PREFIXES = {"os.exec": "processes", "os.spawn": "processes", "os.posix_spawn": "processes"}
BANNED_BUILTINS = {"open": "file access", "eval": "dynamic code", "exec": "dynamic code", "compile": "dynamic code",
                   "__import__": "dynamic import", "globals": "reaching other objects", "breakpoint": "debugger",
                   "input": "reading stdin"}
ALLOWED_DUNDERS = {"__name__", "__doc__", "__init__", "__call__", "__len__"}
REGISTRY_ALLOWED = {"register"}


@dataclass
class Violation:
    line: int
    rule: str
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message} ({self.rule})"

    def to_dict(self) -> dict:
        return {"line": self.line, "rule": self.rule, "message": self.message}


def _banned_module(name: str) -> str | None:
    for mod, why in BANNED_MODULES.items():
        if name == mod or name.startswith(mod + "."):
            return why
    return None


def _banned_name(name: str) -> str | None:
    for full, why in BANNED_NAMES.items():
        if name == full or name.startswith(full + "."):
            return why
    return next((why for p, why in BANNED_PREFIXES.items() if name.startswith(p)), None)


def _reference_names(point: str | None) -> tuple[str | None, str | None]:
    """(the point's module, the reference function's name), or (None, None) for an unknown point."""
    from workbench import registry

    if point not in registry.POINTS:
        return None, None
    return f"workbench.variants.{point}", registry.reference(point).fn.__name__


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
    points = {point} if point else registered_points(tree)
    refs = [_reference_names(p) for p in points]
    out: list[Violation] = []
    aliases: dict[str, str] = {}  # local name -> fully qualified name

    def bad(node, rule, message):
        out.append(Violation(getattr(node, "lineno", 0), rule, message))

    def check_import(node, module: str, local_names: list[tuple[str, str]]):
        why = _banned_module(module)
        if why:
            bad(node, why, f"imports {module}")
            return
        if module == "workbench.registry":
            for name, _ in local_names:
                if name not in REGISTRY_ALLOWED:
                    bad(node, "the reference", f"imports workbench.registry.{name}: only `register` is allowed")
        for mod, ref in refs:
            if module == mod and not local_names:
                bad(node, "the reference", f"imports {mod} as a whole (it holds the reference)")
            if module == mod and any(n == ref for n, _ in local_names):
                bad(node, "the reference", f"imports the reference {mod}.{ref}")
            if module == "workbench.variants" and any(f"workbench.variants.{n}" == mod for n, _ in local_names):
                bad(node, "the reference", f"imports {mod} as a whole (it holds the reference)")
            if module == "workbench" and any(n == "registry" for n, _ in local_names):
                bad(node, "the reference", "imports workbench.registry as a whole")
        for name, local in local_names:
            full = f"{module}.{name}"
            why = _banned_name(full) or _banned_module(full)
            if why:
                bad(node, why, f"imports {full}")
            aliases[local] = full

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                check_import(node, a.name, [])
                if a.name == "workbench.registry":
                    bad(node, "the reference", "imports workbench.registry as a whole: use "
                        "`from workbench.registry import register`")
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                bad(node, "dynamic import", "relative import: a candidate is a standalone module")
                continue
            check_import(node, node.module or "", [(a.name, a.asname or a.name) for a in node.names])

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr.startswith("__") and node.attr not in ALLOWED_DUNDERS:
                bad(node, "reaching other objects", f"uses the attribute {node.attr}")
            full = _qualified(node, aliases)
            if full:
                why = _banned_name(full) or _banned_module(full)
                if why:
                    bad(node, why, f"uses {full}")
                for mod, ref in refs:
                    if full == f"{mod}.{ref}":
                        bad(node, "the reference", f"uses the reference {full}")
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            if node.id in BANNED_BUILTINS and node.id not in aliases:
                bad(node, BANNED_BUILTINS[node.id], f"uses {node.id}()")
            elif node.id == "__builtins__":
                bad(node, "reaching other objects", "uses __builtins__")
    # One report per line and rule: `torch.cuda.Stream()` is one violation, not one per dotted prefix.
    seen, unique = set(), []
    for v in sorted(out, key=lambda v: (v.line, v.rule, -len(v.message))):
        if (v.line, v.rule) not in seen:
            seen.add((v.line, v.rule))
            unique.append(v)
    return unique


def _qualified(node: ast.Attribute, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(parts)])


def check_file(path: str, point: str | None = None) -> list[Violation]:
    with open(path) as f:
        return check_source(f.read(), point, path)
