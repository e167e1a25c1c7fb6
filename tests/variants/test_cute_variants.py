"""The CuTe DSL variants on the CPU (the kernels themselves run in the files' `gpu` tests:
test_cute_boundary.py, test_cute_gemv.py): registered whether or not cutlass is installed, their
variant modules import without it, and `supports` turns down what the kernels cannot do with a reason."""

import importlib.util
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from workbench import registry
from workbench.points import Workload

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAS_CUTLASS = importlib.util.find_spec("cutlass") is not None
KERNELS = {"boundary": "kernels.cute_boundary", "qkvg_proj": "kernels.cute_gemv"}  # point -> its kernel module
POINTS = sorted(KERNELS)


@pytest.mark.parametrize("point", POINTS)
def test_registered_with_its_configs(point):
    v = registry.get(point, "cute")
    assert v.backend == "cute" and v.configs
    assert all(callable(v.at(cfg)) for cfg in v.configs)


@pytest.mark.skipif(HAS_CUTLASS, reason="cutlass is installed here")
@pytest.mark.parametrize("point", POINTS)
def test_unavailable_without_cutlass(point):
    why = registry.get(point, "cute").unsupported(Workload("beam-tiny"))
    assert why is not None and "cutlass" in why
    with pytest.raises(RuntimeError, match="cutlass"):
        registry.bind({point: "cute"})


@pytest.mark.parametrize("point", POINTS)
def test_point_imports_without_the_kernel_module(point):
    """The kernel module (and cutlass) is imported by the variant's first call, not by its module."""
    code = (f"import sys, workbench.variants.{point}.cute; "
            f"assert 'workbench.variants.{KERNELS[point]}' not in sys.modules and 'cutlass' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("preset", ["beam-tiny", "beam-small", "beam-501b-tp8"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_supports_the_presets(point, preset, dtype, batch):
    assert registry.get(point, "cute").supports(Workload(preset, batch=batch, dtype=dtype)) is True


def _hidden(n, dtype="bf16"):
    return SimpleNamespace(config=SimpleNamespace(hidden_size=n), dtype=dtype, tokens=1)


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("workload, words", [
    (Workload("beam-tiny", dtype="fp32"), "fp32"),
    (_hidden(60), "multiple of 8"),
    (_hidden(5124), "multiple of 8"),
])
def test_supports_turns_down_with_a_reason(point, workload, words):
    verdict = registry.get(point, "cute").supports(workload)
    assert isinstance(verdict, str) and words in verdict


def test_boundary_rows_must_fit_one_cta():
    verdict = registry.get("boundary", "cute").supports(_hidden(32768))
    assert isinstance(verdict, str) and "32768" in verdict
