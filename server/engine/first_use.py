"""Triton kernels specialised for the first time in this process, so the engine can name them beside
a slow step: a shape first seen inside a request compiles there, and this says which kernel (and
which of its specialisations) to warm up at start-up.

Triton calls `triton.knobs.runtime.jit_cache_hook` whenever a kernel meets a specialisation (its
argument types, the classes of its integer arguments, its constexprs) that this process has not run
yet, before compiling it or loading it from Triton's disk cache. The hook installed here records the
kernel's signature and returns None: a truthy return would make Triton skip the launch.
"""

from __future__ import annotations

import collections
import threading

_lock = threading.Lock()
_seen: list[str] = []
_installed = False


def install() -> bool:
    """Start recording (once per process; an earlier hook is kept and still called). False without a
    Triton that has the hook (older than 3.4, or none): then nothing is recorded."""
    global _installed
    with _lock:
        if _installed:
            return True
        try:
            from triton import knobs

            previous = knobs.runtime.jit_cache_hook
        except (ImportError, AttributeError):
            return False

        def hook(*args, **kwargs):
            with _lock:
                _seen.append(_signature(kwargs))
            return previous(*args, **kwargs) if previous is not None else None

        knobs.runtime.jit_cache_hook = hook
        _installed = True
        return True


def _signature(hook_kwargs: dict) -> str:
    """`name[num_warps=W](arg: type, ...; CONSTEXPR=value, ...)`, "%16" marking the arguments Triton
    specialised as divisible by 16; Triton's own `repr` where the hook's arguments differ from the
    form known (3.4-3.9: `compile` holds the signature, constexprs by argument index, and attributes)."""
    try:
        c = hook_kwargs["compile"]
        names = list(c["signature"])
        consts = [f"{names[k[0]]}={v}" for k, v in c["constants"].items() if len(k) == 1]
        divisible = {names[k[0]] for k in c["configs"][0] if len(k) == 1}
        args = [f"{n}: {t}" + (" %16" if n in divisible else "") for n, t in c["signature"].items() if t != "constexpr"]
        return f"{hook_kwargs['fn'].name}[num_warps={c['num_warps']}]({', '.join(args)}; {', '.join(consts)})"
    except (KeyError, IndexError, TypeError, AttributeError):
        return hook_kwargs.get("repr") or "?"


def take() -> list[str]:
    """The signatures recorded since the last call (`_signature`), oldest first."""
    global _seen
    with _lock:
        seen, _seen = _seen, []
    return seen


def summary(signatures: list[str]) -> str:
    """Kernel names with counts, e.g. `route_select x2, _qk_prep_kernel`."""
    names = collections.Counter(s.split("[", 1)[0] for s in signatures)
    return ", ".join(name + (f" x{n}" if n > 1 else "") for name, n in names.items())
