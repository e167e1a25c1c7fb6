"""What a candidate variant may use: the static check's allowlist (`ALLOWED`: module -> `Entry`), the
attributes and builtins it refuses, and why each left-out thing is out (`why_not`). Data only, read by
`static_check`; AGENTS.md lists it for people.
"""

from __future__ import annotations

import builtins
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
    # quantized weights as the points receive them, and their formats' arithmetic
    "beam_model.quant.tensors": Entry(project=True),
    "beam_model.quant.formats": Entry(project=True),
    "workbench.registry": _only("register"),
    # kernels/ and every point package and variant module; the point's own reference is refused apart
    "workbench.variants": Entry(project=True, submodules=True, banned={"inputs": "the harness"}),
}
SUMMARY = ("math, itertools, functools, operator, dataclasses, typing, enum, collections, torch (nn, "
           "nn.functional, linalg, fft, special, a few torch.cuda queries), triton (jit, cdiv, ...), "
           "triton.language, numpy, flashinfer, cutlass, cutlass.cute, cuda.bindings.driver.CUstream, quack, "
           "beam_model.functional, beam_model.config, beam_model.quant.tensors and .formats, "
           "workbench.registry.register, workbench.variants.kernels.* and other variants' modules")
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
    # a sandbox's inputs live in shared memory, a served model's do not
    "is_shared": "telling checks from real calls",
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


def is_project(module: str) -> bool:
    return module.split(".")[0] in PROJECT


def why_not(name: str) -> tuple[str, str]:
    """(the rule, a hint of what to use instead) for a module or dotted name left off the allowlist:
    the longest listed prefix's ("os.exec*" matches any name starting "os.exec")."""
    parts, rule, hint = name.split("."), None, None
    for i in range(len(parts), 0, -1):
        p = ".".join(parts[:i])
        rule = rule or WHY.get(p) or next((w for k, w in WHY.items() if k.endswith("*") and p.startswith(k[:-1])), None)
        hint = hint or HINTS.get(p)
    return rule or "not allowed", hint or ""
