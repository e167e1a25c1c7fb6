"""NVTX + torch.profiler ranges around fusion points and layers, installed on a model temporarily."""

from __future__ import annotations

from collections import Counter
from contextlib import ExitStack, contextmanager

from torch.profiler import record_function

from workbench.registry import COMPOUNDS, POINTS, REFERENCE

POINT_RANGE = "fp:"
LAYER_RANGE = "layer."

try:  # NVTX is optional at run time: without it the torch.profiler ranges still attribute time.
    import nvtx as _nvtx
except ImportError:  # pragma: no cover - nvtx is a declared dependency
    _nvtx = None


@contextmanager
def _range(name: str):
    with ExitStack() as stack:
        stack.enter_context(record_function(name))
        if _nvtx is not None:
            stack.enter_context(_nvtx.annotate(name, domain="beam-workbench"))
        yield


class CallLog:
    """Which points were called in which kind of layer ("sliding"/"full"/"model"), how often."""

    def __init__(self):
        self.calls: Counter = Counter()
        self.layer_kind = "model"


@contextmanager
def instrument(model):
    """Within this context every point call and layer of `model` is a named profiler/NVTX range."""
    ops, log = model.ops, CallLog()
    originals = {p: getattr(ops, p) for p in POINTS}

    def wrap(point, fn):
        def run(*args, **kwargs):
            log.calls[(point, log.layer_kind)] += 1
            with _range(POINT_RANGE + point):
                return fn(*args, **kwargs)

        def count(*args, **kwargs):  # a compound running its members: their ranges hold the kernels
            log.calls[(point, log.layer_kind)] += 1
            return fn(*args, **kwargs)
        return count if point in COMPOUNDS and ops.variants[point].name == REFERENCE else run

    @contextmanager
    def annotate(name, layer):
        previous, log.layer_kind = log.layer_kind, "full" if layer.kind == "full_attention" else "sliding"
        try:
            with _range(name):
                yield
        finally:
            log.layer_kind = previous

    for point, fn in originals.items():
        setattr(ops, point, wrap(point, fn))
    model.annotate = annotate
    try:
        yield log
    finally:
        for point, fn in originals.items():
            setattr(ops, point, fn)
        model.annotate = None
