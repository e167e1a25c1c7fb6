"""Lock files: the winning variant set of an optimize run, with the evidence that it was earned.

A lock (YAML, `runs/<name>/lock.yaml`) records the model (preset, config hash, dtype), the target,
the environment it was measured in, and per fusion point: the variant, its backend, the hash of its
source file, its tuning config, candidate and reference timings and the gate evidence. A digest
over the whole body makes any later edit (a timing touched up, a point deleted) visible. `verify`
re-checks all of it and names exactly what differs; loading a lock that fails verification is
refused unless forced. This module never times or gates anything itself: `verify` calls the gates.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import json
import os
import textwrap
from dataclasses import dataclass, field

import yaml

from workbench.code_text import code_text
from workbench.registry import COMPOUNDS, DRAFTER_POINTS, POINTS, REFERENCE, RENAMED, get

SCHEMA = 2  # its code keys: the code a variant runs (`source_hash`); schema 1 hashed file bytes
READABLE = (1, SCHEMA)  # schema 1 locks are read to be shown and to say they must be made again
ENV_KEYS = ("gpu", "torch", "triton", "flashinfer", "cutlass")  # a difference here invalidates timings
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class LockError(ValueError):
    """A lock file that cannot be read or does not describe a build."""


# Op-layer modules a variant module imports to declare itself; they are not the variant's code.
_HARNESS = {"workbench.registry", "workbench.points", "workbench.variants.inputs", "workbench.dtypes"}
_PROJECT = ("workbench", "beam_model")


def _module_file(name: str) -> str | None:
    """The file of project module `name` (a package's `__init__.py`), or None if it is not one."""
    if name.split(".")[0] not in _PROJECT:
        return None
    base = os.path.join(ROOT, *name.split("."))
    for candidate in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


def _outside_functions(node):
    """The nodes under `node` that run when it does: function bodies are left out (they run on a call)."""
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield child
            yield from _outside_functions(child)


def _import_statements(nodes) -> tuple[tuple[str | None, tuple[str, ...]], ...]:
    """(module, names) of each import statement among `nodes`: `from module import names`, or
    (None, names) for `import names`."""
    out = []
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, tuple(a.name for a in node.names)))
        elif isinstance(node, ast.Import):
            out.append((None, tuple(a.name for a in node.names)))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _source_imports(source: str, at_import: bool) -> tuple[tuple[str | None, tuple[str, ...]], ...]:
    """A module text's import statements (with `at_import`, only those importing it runs), parsed
    once per text: the kernel modules most variants share are met again for every variant keyed."""
    tree = ast.parse(source)
    return _import_statements(_outside_functions(tree) if at_import else ast.walk(tree))


def _imported_module_files(statements) -> set[str]:
    """The files of the project modules `statements` run code from. `from pkg import mod` names the
    submodule only; the package's `__init__` counts when a name is taken from it."""
    names = set()
    for module, imported in statements:
        if module is None:
            names.update(imported)
        else:
            names.update(sub if _module_file(sub) else module for sub in (f"{module}.{n}" for n in imported))
    return {path for path in map(_module_file, names - _HARNESS) if path}


def _imported_files(statements, seen: set[str], at_import: bool) -> None:
    """Adds to `seen` the project files `statements` import, and theirs in turn."""
    for path in sorted(_imported_module_files(statements)):
        if path not in seen:
            seen.add(path)
            _project_imports(path, seen, at_import=at_import)


def _project_imports(path: str, seen: set[str] | None = None, *, at_import: bool = False) -> list[str]:
    """Project files a module imports, transitively (module level or inside functions; with
    `at_import`, only what importing it runs), read statically."""
    seen = set() if seen is None else seen
    _imported_files(_source_imports(_read(path), at_import), seen, at_import)
    return sorted(seen)


def _read(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode()


def _source_paths(point: str, variant: str) -> list[str]:
    """The files a variant's key covers: its module, the project modules it imports, the wrapper's."""
    v = get(point, variant)
    # torch_compile: the compile call wraps the point's reference; a sandboxed variant's forwarder is not its code
    wrapper = v.source_file if v.origin else inspect.getsourcefile(v.fn)
    return [v.source_file, *_project_imports(v.source_file), *([wrapper] if wrapper != v.source_file else [])]


def file_key(path: str, *, configs: bool = True) -> str:
    """sha256 (16 hex) of a module's code: its tokens without comments, docstrings or layout
    (`code_text`), and without top-level tuning-config lists unless `configs`. Where a file lives
    and what it says to readers are not part of what runs."""
    return _text_key(_read(path), configs)


@functools.lru_cache(maxsize=None)
def _text_key(source: str, configs: bool) -> str:
    """`file_key` of a module text, computed once per text (most variants share kernel modules)."""
    return hashlib.sha256(code_text(source, configs=configs).encode()).hexdigest()[:16]


def _hash_files(paths, *, configs: bool = True, extra: str = "") -> str:
    """sha256 (16 hex) over the files' code keys, sorted: the same code under other paths keys the same."""
    h = hashlib.sha256()
    for key in sorted(file_key(p, configs=configs) for p in set(paths)):
        h.update(key.encode())
    h.update(extra.encode())
    return h.hexdigest()[:16]


def source_hash(point: str, variant: str) -> str:
    """The key of what a variant runs: its module and the project modules it imports, transitively
    (kernels, math helpers), config lists included. Moving or adding a file it does not import leaves
    it as it is; editing any code it imports changes it."""
    return _hash_files(_source_paths(point, variant))


def reference_key(point: str) -> str:
    """The key of what the point's reference runs: its module and what importing it runs, plus the
    imports inside the reference function itself; not the kernels other variants of the package import
    on their first call. Keys the reference profile and the whole-step torch.compile baselines of an
    optimize run folder, so an edit to a Triton kernel module does not re-time the reference step
    (minutes of device time at full size)."""
    v = get(point, REFERENCE)
    seen = _run_at_import([v.source_file])
    fn = inspect.unwrap(v.fn)
    _imported_files(_import_statements(ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn))))), seen,
                    at_import=True)
    return _hash_files(seen)


def module_key(*modules: str) -> str:
    """The key of project modules (paths from the repository root) and what importing them runs:
    e.g. the model and the target's step runner, which every timing of a step depends on."""
    return _hash_files(_run_at_import([os.path.join(ROOT, m) for m in modules]))


def _run_at_import(paths: list[str]) -> set[str]:
    """`paths` and the project files importing them runs, transitively."""
    seen = set(paths)
    for path in paths:
        _project_imports(path, seen, at_import=True)
    return seen


def code_key(point: str, variant: str, *, own_configs: bool = True) -> str:
    """`source_hash` with the tuning-config lists left out (top-level assignments to names ending in
    CONFIGS, in every covered file) and, with `own_configs`, the variant's own configs hashed instead.
    The search remembers a candidate that hung by it, so adding configs to a module does not make the
    search wait on a known hang again. A lock keeps it without `own_configs`: its entry names the
    config it runs."""
    own = json.dumps(get(point, variant).configs, sort_keys=True, default=str) if own_configs else ""
    return _hash_files(_source_paths(point, variant), configs=False, extra=own)


def code_key_matches(stored, point: str, variant: str, *, own_configs: bool = True) -> bool:
    """Whether a stored `code_key` is this code's."""
    return stored is not None and stored == code_key(point, variant, own_configs=own_configs)


def source_files(point: str, variant: str) -> dict[str, str]:
    """Each covered file's own key, so `verify` can name the file that changed."""
    return {_relative(path): file_key(path) for path in _source_paths(point, variant)}


def _changed_files(locked: dict, now: dict) -> str:
    changed = sorted(p for p in set(locked) | set(now) if locked.get(p) != now.get(p))
    return ", ".join(f"{p} ({'new' if p not in locked else 'gone' if p not in now else 'edited'})" for p in changed)


def run_by(selection: dict[str, str]) -> dict[str, str]:
    """Members of a compound selected at a fused variant, each with it ("attention_out:triton"): that
    variant runs their work, so their own selections never run."""
    return {m: f"{c}:{selection[c]}" for c, members in COMPOUNDS.items()
            if selection.get(c, REFERENCE) != REFERENCE for m in members}


def _relative(path: str) -> str:
    return os.path.relpath(path, ROOT) if path.startswith(ROOT) else path


@dataclass
class Lock:
    model: dict                      # preset, config_hash, dtype
    target: str
    environment: dict
    points: dict[str, dict]          # point -> {variant, backend, source, source_hash, config, timing, gate}
    end_to_end: dict = field(default_factory=dict)
    command: str = ""
    created: str = ""
    schema: int = SCHEMA             # the form of its code keys; only SCHEMA's can be verified

    # ---- building ----------------------------------------------------------------------
    @staticmethod
    def entry(point: str, variant: str, *, config: dict | None = None, timing: dict | None = None,
              gate: dict | None = None, calls: int | None = None) -> dict:
        """A point's entry; `calls`: how often the target's step calls the point (0: never, so no change of its
        code changes the locked build; None: not recorded, every change counts)."""
        v = get(point, variant)
        return {"variant": variant, "backend": v.backend, "source": _relative(v.source_file),
                "source_hash": source_hash(point, variant), "source_files": source_files(point, variant),
                "code_key": code_key(point, variant, own_configs=False), "config": config or None,
                "timing": timing or {}, "gate": gate or {}, **({"calls": calls} if calls is not None else {})}

    @property
    def selection(self) -> dict[str, str]:
        return {p: e["variant"] for p, e in self.points.items()}

    @property
    def configs(self) -> dict[str, dict]:
        return {p: e["config"] for p, e in self.points.items() if e.get("config")}

    def current_selection(self) -> tuple[dict[str, str], list[str]]:
        """The selection under today's variant names (`registry.RENAMED`), and a note for each renamed one."""
        selection, notes = {}, []
        for point, variant in self.selection.items():
            selection[point] = RENAMED.get((point, variant), variant)
            if selection[point] != variant:
                notes.append(f"{point}:{variant} is registered as {point}:{selection[point]} now")
        return selection, notes

    # ---- (de)serialisation -------------------------------------------------------------
    def _body(self) -> dict:
        body = {"schema": self.schema, "created": self.created, "command": self.command, "model": self.model,
                "target": self.target, "environment": self.environment, "points": self.points,
                "end_to_end": self.end_to_end}
        return json.loads(json.dumps(body, default=str))  # plain types only (versions are str subclasses)

    @staticmethod
    def _digest(body: dict) -> str:
        return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def save(self, path: str) -> None:
        body = self._body()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            yaml.safe_dump({**body, "digest": self._digest(body)}, f, sort_keys=False)

    @classmethod
    def load(cls, path: str) -> tuple["Lock", list[str]]:
        """The lock and the problems found just by reading it (digest mismatch, missing points)."""
        if not os.path.isfile(path):
            raise LockError(f"no lock file at {path}")
        with open(path) as f:
            try:
                raw = yaml.safe_load(f)
            except yaml.YAMLError as e:
                raise LockError(f"{path} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise LockError(f"{path} does not hold a lock (expected a mapping at the top)")
        missing = [k for k in ("schema", "model", "target", "environment", "points", "digest") if k not in raw]
        if missing:
            raise LockError(f"{path} lacks the fields {missing}")
        if raw["schema"] not in READABLE:
            raise LockError(f"{path} has lock schema {raw['schema']}, this workbench reads {SCHEMA}")
        if not isinstance(raw["points"], dict):
            raise LockError(f"{path}: 'points' must map fusion points to entries")
        for point, e in raw["points"].items():
            if not isinstance(e, dict) or "variant" not in e:
                raise LockError(f"{path}: point {point!r} has no variant")
        lock = cls(model=raw["model"], target=raw["target"], environment=raw["environment"],
                   points=raw["points"], end_to_end=raw.get("end_to_end") or {},
                   command=raw.get("command", ""), created=raw.get("created", ""), schema=raw["schema"])
        problems = []
        if cls._digest(lock._body()) != raw["digest"]:
            problems.append("lock contents were edited after it was written (digest mismatch)")
        # a compound is absent from locks written before it existed: those builds run its members apart;
        # a drafter's point from those of steps that run no drafter (they never call it)
        absent = [p for p in POINTS if p not in lock.points and p not in COMPOUNDS]
        if any(p in DRAFTER_POINTS for p in absent) and not _runs_drafter(lock.target):
            absent = [p for p in absent if p not in DRAFTER_POINTS]
        if absent:
            problems.append(f"points missing from the lock: {absent}")
        unknown = [p for p in lock.points if p not in POINTS]
        if unknown:
            problems.append(f"unknown fusion points in the lock: {unknown}")
        return lock, problems


def _runs_drafter(target: str) -> bool:
    """Whether a lock's target step runs a DFlash drafter (a name no target has: assume it may)."""
    from workbench.targets import TARGETS  # deferred: only a lock that lacks one asks, and targets imports torch

    return TARGETS[target].draft if target in TARGETS else True


@dataclass
class Verification:
    lock: Lock
    problems: list[str]
    gate_reports: dict[str, dict] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what changed without changing the locked build

    @property
    def ok(self) -> bool:
        return not self.problems


def register_outside_source(point: str, entry: dict, *, sandboxed: bool, device) -> None:
    """A variant from outside the package (an agent's accepted file under runs/) is registered from
    the file the lock names; its source hash is then checked like any other. `sandboxed`: its code runs
    in a sandbox process, so what it does on import cannot reach the gates that verify it."""
    from workbench.agent.candidates import ensure_registered
    from workbench.agent.plugins import PluginError

    try:
        ensure_registered(point, entry["variant"], entry.get("source"), ROOT, sandboxed=sandboxed, device=device)
    except PluginError as e:
        raise KeyError(str(e)) from None


def verify(path: str, *, environment: dict | None = None, run_gates: bool = True, device=None) -> Verification:
    """Re-check a lock: its digest, every point's variant and source hash, the environment, the gates.
    With `run_gates`, a variant from outside the package runs in a sandbox and is never imported here."""
    if not run_gates:
        return _verify(path, environment, run_gates, device)
    import torch

    from workbench.agent.candidates import close_sandboxed, sandbox_count

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")  # the gates' and the sandboxes'
    keep = sandbox_count()
    try:
        return _verify(path, environment, run_gates, device)
    finally:
        close_sandboxed(keep)


def _verify(path: str, environment: dict | None, run_gates: bool, device) -> Verification:
    lock, problems = Lock.load(path)
    notes = []
    if lock.schema != SCHEMA:
        problems.append(f"lock schema {lock.schema}: its code keys hash the files of the tree it was made on, "
                        f"which this workbench (schema {SCHEMA}) does not compute; make it again on its device "
                        f"(`workbench optimize` with the lock's command) to verify it")
    for point, e in lock.points.items():
        if point not in POINTS:
            continue
        try:
            register_outside_source(point, e, sandboxed=run_gates, device=device)
            get(point, e["variant"])
        except KeyError as err:
            problems.append(f"{point}: {err.args[0]}")
            continue
        if lock.schema != SCHEMA:  # its keys are of another form: nothing to compare them with
            continue
        now = source_hash(point, e["variant"])
        if now != e.get("source_hash"):
            files = e.get("source_files")
            where = _changed_files(files, source_files(point, e["variant"])) if isinstance(files, dict) else None
            changed = f"source of {e['variant']} ({e.get('source')}) changed (locked {e.get('source_hash')}, " \
                      f"now {now})" + (f": {where}" if where else "")
            # Tuning-config lists aside, the code is the same and the entry names its config: the same
            # build. (A default config, None, may be read off such a list, so it needs the whole hash.)
            same_code = code_key_matches(e.get("code_key"), point, e["variant"], own_configs=False)
            if e.get("calls") == 0:  # e.g. the experts of a drafter's step: the build never runs this code
                notes.append(f"{point}: {changed}; the lock's step never calls it")
            elif e.get("config") is not None and same_code:
                notes.append(f"{point}: {changed}; tuning-config lists only, the locked config is the lock's own")
            else:
                problems.append(f"{point}: {changed}")
    if environment is None:
        from workbench.provenance import environment as current_environment

        environment = current_environment()
    for key in ENV_KEYS:
        if lock.environment.get(key) != environment.get(key):
            problems.append(f"environment {key}: locked {lock.environment.get(key)!r}, here {environment.get(key)!r}")
    from beam_model.config import BeamConfig

    preset = lock.model.get("preset")
    if preset and BeamConfig.from_preset(preset).config_hash() != lock.model.get("config_hash"):
        problems.append(f"model: preset {preset} no longer has config hash {lock.model.get('config_hash')}")
    report = Verification(lock, problems, notes=notes)
    if run_gates and not problems:
        from workbench.gates import lock_gates

        report.gate_reports = lock_gates(lock, device=device)
        report.problems += [f"{p}: gate failed again ({r.get('failed')})"
                            for p, r in report.gate_reports.items() if not r.get("passed")]
    return report


def load_for_serving(path: str, *, force: bool = False, device=None) -> Lock:
    """A lock fit to serve: verified (without re-running gates if forced), else a LockError naming why."""
    return load_forced(path, force=force, device=device)[0]


def load_forced(path: str, *, force: bool = False, device=None) -> tuple[Lock, list[str]]:
    """`load_for_serving`'s lock and the verification problems `force` let it past (none when it verifies),
    for whoever reports a figure measured on it."""
    result = verify(path, run_gates=False, device=device)
    if result.problems and not force:
        raise LockError(f"lock {path} failed verification: " + "; ".join(result.problems)
                        + " (use --force-lock to use it anyway)")
    return result.lock, result.problems
