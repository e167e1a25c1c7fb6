"""Helpers shared by the variant tests."""

import dataclasses
import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

from beam_model.quant.tensors import Fp8Weight, Nvfp4Weight
from workbench import gates, registry
from workbench.quarantine import quarantined

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def available(point: str, name: str):
    """The variant, or skip the test with the reason its backend cannot run here."""
    v = registry.get(point, name)
    ok, why = registry.backend_available(v.backend)
    if not ok:
        pytest.skip(why)
    return v


def callables(v, extra=()):
    """(label, callable): the default and every tuning config (plus `extra` configs), each separately
    compiled or planned, so each is checked."""
    return [("default", v.fn)] + [(str(cfg), v.at(cfg)) for cfg in [*v.configs, *extra]]


def failures(report) -> list[tuple]:
    """The first failed checks of an op-gate report, for an assertion message."""
    return [(c.name, c.case, c.error, c.detail) for c in report.failures][:5]


def assert_every_config_passes(v, workloads, **gate_kw) -> None:
    """The op gate for each tuning config of `v` in turn (the gate runs variant.fn: bind each one), at
    the workloads its `config_supports` lets it run, as a search would; at least one config runs."""
    ran = 0
    for config in v.configs:
        runs = [wl for wl in workloads if v.unsupported_config(config, wl) is None]
        if runs:
            report = gates.op_gate(dataclasses.replace(v, fn=v.at(config)), runs, **gate_kw)
            assert report.passed, (config, failures(report))
            ran += 1
    assert ran, f"no config of {v.qualname} runs at {[wl.label() for wl in workloads]}"


def with_config(wl, **changes):
    """`wl` as a variant's `supports` reads it, with config fields changed: a shape no preset has (a
    Workload takes its config from its preset)."""
    return types.SimpleNamespace(config=dataclasses.replace(wl.config, **changes), dtype=wl.dtype, tokens=wl.tokens)


def prefill_workloads(preset: str) -> list:
    """The two prefill layouts the GPU tests of prefill-only variants gate at: 2 x 512 and 1 x 2048 tokens."""
    from workbench.points import Workload

    return [Workload(preset, batch=2, tokens_per_seq=512, context=512),
            Workload(preset, batch=1, tokens_per_seq=2048, context=2048)]


def on_gpu_unless_quarantined(point: str, name: str):
    """Skip marker for a variant's GPU tests: they need CUDA, and wait while the variant is quarantined
    there (it hangs or fails; `workbench check POINT:NAME --device cuda` runs it regardless)."""
    why = "needs a CUDA GPU" if not torch.cuda.is_available() else quarantined(point, name, "cuda")
    return pytest.mark.skipif(why is not None, reason=why or "")


def stand_in_flashinfer(monkeypatch, submodule: str, **functions):
    """Install, for one test, a stand-in `flashinfer.<submodule>` (dotted paths too) holding `functions`
    (the CPU tests drive FlashInfer adapters through it without the library); returns the submodule.
    Calls compose: a parent another call stood in is kept, so two submodules can stand in at once."""
    parent, name = None, "flashinfer"
    for part in submodule.split("."):
        parent, name = _stand_in_module(monkeypatch, name, parent), f"{name}.{part}"
    sub = _stand_in_module(monkeypatch, name, parent)
    for attr, fn in functions.items():
        setattr(sub, attr, fn)
    return sub


def _stand_in_module(monkeypatch, name: str, parent):
    module = sys.modules.get(name)
    if not getattr(module, "__stand_in__", False):
        module = types.ModuleType(name)
        module.__stand_in__ = True
        monkeypatch.setitem(sys.modules, name, module)
    if parent is not None:
        setattr(parent, name.rsplit(".", 1)[1], module)
    return module


E4M3_NAN = 0x7F  # float8_e4m3fn's NaN (S.1111.111), set through a uint8 view: fp8 tensors take no fills


def poisoned_experts(w, experts):
    """Copies of the quantized weights with NaN in `experts`' scales (and FP8 values): no kernel may read them."""
    out = {}
    for k, v in w.items():
        if isinstance(v, Fp8Weight):
            v = Fp8Weight(v.weight.clone(), v.scale.clone())
            v.weight.view(torch.uint8)[experts] = E4M3_NAN
            v.scale[experts] = float("nan")
        else:
            v = Nvfp4Weight(v.weight, v.scale.clone(), v.scale_2.clone())
            v.scale.view(torch.uint8)[experts] = E4M3_NAN
            v.scale_2[experts] = float("nan")
        out[k] = v
    return out


def edited_module(path: Path, marker: str, edit: tuple[str, str], tmp_path: Path, name: str):
    """A copy of the module at `path` with `edit` (old, new) made on its one line holding `marker`, imported as
    `name` from `tmp_path`: a planted fault in a real kernel, one line changed."""
    lines = path.read_text().splitlines(keepends=True)
    (at,) = [i for i, line in enumerate(lines) if marker in line]  # the kernel changed if this fails: re-plant
    assert edit[0] in lines[at], (marker, edit)
    lines[at] = lines[at].replace(*edit)
    copy = tmp_path / f"{name}.py"
    copy.write_text("".join(lines))
    module_spec = importlib.util.spec_from_file_location(name, copy)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # triton resolves a kernel's globals through its module
    module_spec.loader.exec_module(module)
    return module
