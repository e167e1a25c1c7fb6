"""The activation dtypes the workbench runs, by the short names that CLI flags, lock files and
workloads use. The one table of them: everything else looks names, torch dtypes and sizes up here.
This module imports only torch."""

from __future__ import annotations

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_BYTES = {name: torch.empty((), dtype=dt).element_size() for name, dt in DTYPES.items()}
DTYPE_NAMES = {dt: name for name, dt in DTYPES.items()}


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a short name, or a ValueError that lists the names."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; dtypes: {', '.join(DTYPES)}") from None


def name_of(dtype: torch.dtype) -> str:
    """The short name of a torch dtype (torch.bfloat16 -> "bf16")."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not one the workbench runs; dtypes: {', '.join(DTYPES)}") from None
