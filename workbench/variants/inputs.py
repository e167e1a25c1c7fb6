"""Shared input-making for the fusion points' `PointSpec`s: seeded tensors at a workload's shapes,
weights scaled like `beam_model/weights.py`, and a real paged KV cache with scattered pages.

Only the spec declarations in `workbench/variants/<point>.py` use this; gates and timing see just
the `Call`s they build. Inputs for one workload always have the same layout (shapes, page ids,
slots) whatever the seed; only values change, so a gate can write the next seed's values into the
same tensors. This module must never import a variant, the model or the gates.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import torch

from beam_model.config import FULL, SLIDING
from beam_model.kv_cache import PAGE_SIZE, PagedKVCache
from workbench.dtypes import DTYPE_BYTES, DTYPES  # noqa: F401  (specs import DTYPE_BYTES from here)


class Rand:
    """Seeded draws on the target device, one stream per (point, seed) so points never share values."""

    def __init__(self, point: str, workload, device, seed: int):
        self.device = torch.device(device)
        self.dtype = DTYPES[workload.dtype]
        digest = hashlib.sha256(f"{point}:{seed}".encode()).digest()
        self.gen = torch.Generator(device=self.device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)

    def normal(self, *shape: int, mean: float = 0.0, std: float = 1.0, dtype=None) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype or self.dtype, device=self.device)
        return t.normal_(mean, std, generator=self.gen)

    def linear(self, *shape: int, dtype=None) -> torch.Tensor:
        """A [..., out, in] weight with std 1/sqrt(in): unit-variance outputs, as in weights.py."""
        return self.normal(*shape, std=1.0 / math.sqrt(shape[-1]), dtype=dtype)

    def norm(self, dim: int) -> torch.Tensor:
        return self.normal(dim, mean=1.0, std=0.1)

    def uniform(self, *shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=self.gen, device=self.device)


def weight_bytes(workload, formats, rows: int, cols: int) -> float:
    """The bytes of one [rows, cols] projection as the workload stores it: in `workload.weights` where
    that is one of `formats` (the formats that quantize the point's projections), else in the model dtype.
    FP8: a byte a weight and an FP32 scale a row; NVFP4: half a byte a weight, an E4M3 scale per 16 and
    an FP32 global scale."""
    fmt = workload.weights if workload.weights in formats else "bf16"
    if fmt == "fp8":
        return rows * cols + 4 * rows
    if fmt == "nvfp4":
        return rows * cols / 2 + rows * cols / 16 + 4
    return DTYPE_BYTES[workload.dtype] * rows * cols


def paged_kv(workload, rand: Rand):
    """A real `PagedKVCache` holding `batch` sequences of `context` tokens, the last `tokens_per_seq`
    of them new in this step; returns (this layer kind's cache [pages, 2, page_size, kv_heads, hd],
    the step's AttentionMetadata). Every slot holds random K/V (page 0 and free pages too, so a kernel
    reading a page it must not see gets garbage, not zeros). Earlier context is prefilled one page
    per step with a dummy sequence taking a page in between and the batch order flipping, so each
    sequence's pages are scattered and out of order; sliding-window pages out of the window are
    released as in serving."""
    c, b, t, ctx = workload.config, workload.batch, workload.tokens_per_seq, workload.context
    if not 1 <= t <= ctx:
        raise ValueError(f"workload needs 1 <= tokens_per_seq <= context, got {t} and {ctx}")
    # One layer of each kind is all a point sees; the model's other layers would only cost memory.
    two = dataclasses.replace(c, num_hidden_layers=2, layer_types=[SLIDING, FULL], first_k_dense_replace=0)
    prefix = ctx - t
    chunks = math.ceil(prefix / PAGE_SIZE)
    pages = b * math.ceil(ctx / PAGE_SIZE) + chunks + 2
    kv = PagedKVCache(two, pages, dtype=rand.dtype, device=rand.device)
    seqs = list(range(b))
    for s in seqs:
        kv.add(s)
    for i in range(chunks):
        n = min(PAGE_SIZE, prefix - i * PAGE_SIZE)
        kv.add(("dummy", i))
        order = seqs if i % 2 == 0 else seqs[::-1]
        kv.prepare_step([("dummy", i), *order], [1] + [n] * b)
    step = kv.prepare_step(seqs, [t] * b)
    group = SLIDING if workload.layer == "sliding" else FULL
    cache = kv.storage[group][0]
    cache.normal_(generator=rand.gen)
    return cache, step.groups[group]


def layer_kwargs(workload) -> dict:
    """Position handling of the workload's layer kind: RoPE on sliding layers, SSMax on full ones."""
    c = workload.config
    if workload.layer == "sliding":
        return dict(rope_theta=c.rope_theta, ssmax=None)
    if workload.layer == "full":
        return dict(rope_theta=None, ssmax=(c.ssmax_base, c.ssmax_exponent))
    raise ValueError(f"workload layer must be 'sliding' or 'full', got {workload.layer!r}")


def visible_keys(workload) -> list[int]:
    """How many keys each query of one sequence sees (window-limited on sliding layers)."""
    c, t, ctx = workload.config, workload.tokens_per_seq, workload.context
    window = c.sliding_window if workload.layer == "sliding" else None
    return [p + 1 if window is None else min(p + 1, window) for p in range(ctx - t, ctx)]
