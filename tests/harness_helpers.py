"""Shared set-ups of the harness tests (tests/workbench/): a tiny target step to search and time on
the CPU, the options of a tiny optimize run, and timing knobs that keep tests quick."""

import fcntl
import os
import pickle

import torch

POINTS_SEARCHED = ("boundary", "qkvg_proj")  # what a tiny optimize run searches
FAST = dict(warmup=2, min_reps=10, max_reps=60, max_seconds=0.2)  # timing knobs that keep tests quick
STEP_SAMPLES_S = 0.3  # seconds of samples per build timing in a tiny optimize run's end-to-end stage
CEILINGS = {"bandwidth_Bps": 1e11, "matmul_flops": 1e12}  # made-up device ceilings


def tiny_runner():
    """A decode-b1 step of beam-tiny in FP32 on the CPU: what the search tests build a Search on."""
    from beam_model import BeamForCausalLM
    from workbench.targets import StepRunner, for_device, get_target

    model = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32)
    return StepRunner(model, for_device(get_target("decode-b1"), model.device))


def tiny_options(out_dir, **kw):
    """The options of a tiny optimize run: decode-b1 on beam-tiny, FP32 on the CPU, POINTS_SEARCHED."""
    from workbench.optimize import OptimizeOptions

    return OptimizeOptions(**{"target": "decode-b1", "preset": "beam-tiny", "dtype": torch.float32,
                              "device": torch.device("cpu"), "out_dir": str(out_dir), "points": POINTS_SEARCHED,
                              "command": "pytest", "step_samples_s": STEP_SAMPLES_S, **kw})


def made_once(tmp_path_factory, name: str, make):
    """`make()`'s result, made by the first pytest-xdist worker that asks and read (pickled) by the others:
    a costly read-only set-up is made once per test session, not once per worker. Whatever `make()` writes
    stays where it wrote it (its worker's temp folder lives as long as the session)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return make()
    root = tmp_path_factory.getbasetemp().parent  # shared by the session's workers
    path = root / f"{name}.pickle"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return pickle.loads(path.read_bytes())
        value = make()
        path.write_bytes(pickle.dumps(value))
        return value
