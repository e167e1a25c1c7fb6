"""Test session set-up: Triton kernels run under the interpreter when there is no GPU.

TRITON_INTERPRET must be set before any module defines a @triton.jit kernel, hence here.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(min(torch.get_num_threads(), 4))
