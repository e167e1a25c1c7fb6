"""The test session's shortcut for interpreted @jit helpers (`interpreter_patching.py`): a helper reuses its
launch's patch of triton.language, and the kernel computes what it computed without the shortcut."""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter's")

triton = pytest.importorskip("triton")
tl = triton.language


@triton.jit
def _twice(x):
    return x + x


@triton.jit
def _kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    for _ in tl.static_range(4):
        x = _twice(x)
    tl.store(y_ptr + offs, x)


def _walks(monkeypatch) -> list:
    """The modules the interpreter walks to patch them, appended as it walks them."""
    from triton.runtime import interpreter

    walked, walk = [], interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda pkg, *a: (walked.append(pkg), walk(pkg, *a))[1])
    return walked


def _run() -> torch.Tensor:
    x = torch.arange(8, dtype=torch.float32)
    y = torch.empty_like(x)
    _kernel[(1,)](x, y, N=8)
    return y


def test_helpers_reuse_the_launchs_patch_and_compute_the_same(monkeypatch):
    from triton.runtime import interpreter

    assert getattr(interpreter, "_reuses_the_launch_patch", False)  # installed by conftest.py
    walked = _walks(monkeypatch)
    assert torch.equal(_run(), 16 * torch.arange(8, dtype=torch.float32))
    per_patch = len(walked)  # one launch: one patch, none for the four helper calls
    assert per_patch > 0
    _run()
    assert len(walked) == 2 * per_patch


def test_without_the_shortcut_every_helper_call_walks_the_modules_again(monkeypatch):
    import interpreter_patching
    from triton.runtime import interpreter

    monkeypatch.setattr(interpreter, "_patch_lang", interpreter_patching.original_patch_lang)
    walked = _walks(monkeypatch)
    assert torch.equal(_run(), 16 * torch.arange(8, dtype=torch.float32))
    once = len(walked)
    monkeypatch.undo()  # the shortcut back
    walked = _walks(monkeypatch)
    _run()
    assert once == 5 * len(walked)  # the launch's walk and one per helper call, against the launch's alone
