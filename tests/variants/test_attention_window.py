"""`attention:window` (the reference's math over a sliding query's window of pages) against the reference.

Hand-built caches (attention_cases.py) put NaN wherever a read must not reach (released pages, rows
before the window, rows past a sequence's length), so a window that starts a page too late or reads a
page it should mask shows up as a NaN or as another output. (The op gate: test_every_variant.py.)
"""

import pytest
import torch

from tests.variants.attention_cases import _assert_close, _case
from workbench import registry


def _both(q, cache, meta, window):
    scale = q.shape[-1] ** -0.5
    want = registry.reference("attention").fn(q, cache, meta, window=window, scale=scale)
    return registry.get("attention", "window").fn(q, cache, meta, window=window, scale=scale), want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [1, 5, 8, 9, 12], ids=lambda w: f"win{w}")
def test_decode_matches_reference(window, dtype):
    """Every position over three pages and then some (page 4): windows shorter than a page, a page
    exactly, just past one, and across three; the oldest visible key at every offset in its page."""
    ctx = list(range(0, 23))
    q, cache, meta = _case(ctx, [1] * len(ctx), heads=6, kv_heads=1, hd=16, page=4, window=window, dtype=dtype,
                           seed=window)
    got, want = _both(q, cache, meta, window)
    _assert_close(got, want, f"window {window}")


@pytest.mark.parametrize("window", [None, 5, 9], ids=["full", "win5", "win9"])
def test_prompt_chunks_match_the_reference(window):
    """Chunks after contexts of 0 to past two windows (page 4), each read from its first query's window."""
    q, cache, meta = _case([0, 3, 6, 13, 21], [3, 1, 5, 2, 4], heads=4, kv_heads=2, hd=16, page=4, window=window,
                           dtype=torch.float32, seed=7)
    got, want = _both(q, cache, meta, window)
    _assert_close(got, want, f"prompt window {window}")


def test_full_layer_decode_is_the_reference_bit_for_bit():
    """Without a window every page is read, in the reference's order and math."""
    q, cache, meta = _case([6, 9, 30], [1, 1, 1], heads=4, kv_heads=2, hd=16, page=4, window=None,
                           dtype=torch.float32)
    got, want = _both(q, cache, meta, None)
    assert torch.equal(got, want)


def test_compiles_whole():
    """Under torch.compile with fullgraph (no graph break: the baseline compiles the step whole)."""
    q, cache, meta = _case([7, 20], [1, 1], heads=6, kv_heads=1, hd=16, page=4, window=6, dtype=torch.float32,
                           poison_window=False)
    fn = registry.get("attention", "window").fn
    compiled = torch.compile(lambda q, cache, meta: fn(q, cache, meta, window=6, scale=0.25), fullgraph=True)
    _assert_close(compiled(q, cache, meta), fn(q, cache, meta, window=6, scale=0.25), "compiled")
