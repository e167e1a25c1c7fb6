"""Under TRITON_INTERPRET, Triton patches `triton.language` for each kernel launch and again for every
@jit helper the kernel calls (`interpreter._patch_lang`, which walks the modules' members each time),
although the launch's own patch is still in force. `reuse_the_launch_patch` makes a helper's call reuse
the launch's patch when the helper sees no language module the launch did not patch (else it patches as
before). Nothing else changes: the same patched functions run either way, and each launch restores the
modules as before. Installed for the CPU test session (conftest.py); it does nothing where this Triton's
interpreter lacks the pieces it wraps."""

import inspect
import threading

_launch = threading.local()  # per thread: the kernel being launched, then the modules its launch patched
original_patch_lang = None  # the interpreter's own, once the shortcut wraps it


def _langs(fn, tl) -> set[int]:
    return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}


def reuse_the_launch_patch() -> bool:
    """Install it; False where the interpreter's internals are not the ones it wraps (or already done)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    if not all(hasattr(interpreter, n) for n in ("_patch_lang", "_LangPatchScope", "GridExecutor", "tl")) \
            or getattr(interpreter, "_reuses_the_launch_patch", False):
        return False
    global original_patch_lang
    patch_lang, launch, tl = interpreter._patch_lang, interpreter.GridExecutor.__call__, interpreter.tl
    original_patch_lang = patch_lang

    def patch(fn):
        if getattr(_launch, "kernel", None) is fn:  # the launch's own patch
            _launch.kernel, _launch.langs = None, _langs(fn, tl)
            return patch_lang(fn)
        langs = getattr(_launch, "langs", None)
        if langs is not None and _langs(fn, tl) <= langs:
            return interpreter._LangPatchScope()  # a helper: the launch's patch holds; nothing to undo
        return patch_lang(fn)

    def launch_recorded(self, *args, **kwargs):
        outer = getattr(_launch, "kernel", None), getattr(_launch, "langs", None)
        _launch.kernel, _launch.langs = self.fn, None
        try:
            return launch(self, *args, **kwargs)
        finally:
            _launch.kernel, _launch.langs = outer

    interpreter._patch_lang = patch
    interpreter.GridExecutor.__call__ = launch_recorded
    interpreter._reuses_the_launch_patch = True
    return True
