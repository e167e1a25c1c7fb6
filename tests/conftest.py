"""Test session set-up: Triton kernels run under the interpreter when there is no GPU (its @jit helpers
reusing their launch's patch of triton.language: `interpreter_patching.py`), and each pytest-xdist worker
runs as many intra-op threads as it has cores to itself.

TRITON_INTERPRET must be set before any module defines a @triton.jit kernel, hence here.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from interpreter_patching import reuse_the_launch_patch

    reuse_the_launch_patch()


def _threads() -> int:
    """At most 4 intra-op threads; under pytest-xdist, the worker's share of the cores. Workers that
    run more OpenMP threads between them than there are cores stall each other: a thread waiting at an
    op's barrier for one that another worker keeps off its core makes every small op wait a scheduler
    slice (beam-tiny's model gate and decode step took 5-10x longer beside a busy worker on 2 cores)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), 4, cores // workers))


torch.set_num_threads(_threads())
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())  # and the processes its tests start


def pytest_collection_modifyitems(config, items):
    """`-m gpu` tests need CUDA: without it they are skipped with that reason, not failed."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="a `gpu` test: needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
