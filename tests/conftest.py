"""Test session set-up: Triton kernels run under the interpreter when there is no GPU.

TRITON_INTERPRET must be set before any module defines a @triton.jit kernel, hence here.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(min(torch.get_num_threads(), 4))


def pytest_collection_modifyitems(config, items):
    """`-m gpu` tests need CUDA: without it they are skipped with that reason, not failed."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="a `gpu` test: needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
