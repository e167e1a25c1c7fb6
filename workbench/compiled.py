"""The `torch_compile` variant every point has: its reference under torch.compile, compiled on first call.

A module of its own: a variant's key covers the file of the function it runs, which for this wrapper is
this one, so editing the registry (a point or a list added) leaves every point's torch_compile key, and
with it the cached searches of every run folder, as they were.
"""

from typing import Callable


def compiled(fn: Callable) -> Callable:
    """The reference under torch.compile, compiled on first call (compiling at import would be slow)."""
    graph = None

    def run(*args, **kwargs):
        nonlocal graph
        if graph is None:
            import torch
            import torch._dynamo

            # One compiled graph per distinct shape/kwargs (layer kinds, prefill layouts): past dynamo's
            # default limit of 8 it would silently run eagerly and be timed as if compiled.
            cfg = torch._dynamo.config
            limit = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
            setattr(cfg, limit, max(getattr(cfg, limit), 64))
            graph = torch.compile(fn, dynamic=False)
        return graph(*args, **kwargs)

    run.__wrapped__ = fn
    run.__name__ = f"compiled_{fn.__name__}"
    return run
