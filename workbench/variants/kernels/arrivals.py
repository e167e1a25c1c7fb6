"""Arrival counters for kernels whose last program to finish does a final step (`attention:triton`'s
split merge, `route:triton`'s selection, `experts:triton`'s split-K SwiGLU): each program counts
itself in with an atomic after its partial results are stored, and the one that counts last reads
them all and resets the counter.

Torch only (no triton import): the kernels take the counters as a plain int32 tensor. Each kernel
family has its own buffer per device; a buffer's counters are only consistent between launches, so two
launches using one buffer must not run at once (they never do on one stream, as the model runs).
"""

import torch

COUNTERS: dict[tuple[torch.device, str], torch.Tensor] = {}


def arrival_counters(n: int, device: torch.device, owner: str) -> torch.Tensor:
    """At least n zeroed int32 counters of `owner` (a kernel family) on `device`. Every launch leaves
    the counters it used at 0, so one zeroed buffer per owner and device serves every call without a
    memset in the step; it is allocated outside CUDA graph capture only (memory allocated while
    capturing belongs to that graph's pool), and a capture that needs more than exists gets its own
    zeroed counters, memset included."""
    have = COUNTERS.get((device, owner))
    if have is not None and have.numel() >= n:
        return have
    fresh = torch.zeros(max(n, 64), dtype=torch.int32, device=device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return fresh
    COUNTERS[(device, owner)] = fresh
    return fresh
