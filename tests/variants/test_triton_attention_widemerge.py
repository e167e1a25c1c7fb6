"""`attention:triton_widemerge`: attention:triton_prefetch's decode kernel with a merge that loads every
split's partials in one round trip. The decode partials are the prefetch kernel's, so its output is
attention:triton_prefetch's up to the order the merge sums the splits in (checked on the CPU
interpreter over the NaN-poisoned cases of attention_cases.py, with empty splits, one block and
several a split); a config making more splits than one merge tile holds is refused by name. On the
GPU: a CUDA-graph replay with new contents. (The op gate, every config: test_every_variant.py.)
"""

import pytest
import torch

from tests.variants.attention_cases import _case, check_graph_replay
from tests.variants.helpers import available, needs_cuda
from workbench import registry

# tests/variants/test_triton_attention_prefetch.py's SMALL: tiny blocks, so small contexts cross blocks and splits
SMALL = dict(BLOCK_N=16, MIN_BLOCKS=1, WAVES=64, MAX_SPLITS=8, num_warps=2, num_stages=1, PREFILL_BLOCK_M=16,
             PREFILL_BLOCK_N=16, PREFILL_WARPS=2, PREFILL_STAGES=1, FUSED_MERGE_MAX_SPLITS=0, EARLY_V=False)


@pytest.mark.parametrize("max_splits,merge_block_d", [(8, 8), (2, 32), (8, 16)])
@pytest.mark.parametrize("window", [None, 12], ids=["full", "win12"])
def test_decode_is_attention_triton_prefetch_up_to_summation_order(window, max_splits, merge_block_d):
    wide, prefetch = available("attention", "triton_widemerge"), available("attention", "triton_prefetch")
    cfg = dict(SMALL, MAX_SPLITS=max_splits, PREFETCH_V=True)
    for dtype, tol in ((torch.bfloat16, 8e-3), (torch.float32, 1e-6)):
        q, cache, meta = _case([70, 5, 33, 0], [1] * 4, heads=6, kv_heads=1, hd=32, page=8, window=window,
                               dtype=dtype)
        want = prefetch.at(cfg)(q, cache, meta, window=window, scale=0.25)
        got = wide.at(dict(cfg, MERGE_BLOCK_D=merge_block_d))(q, cache, meta, window=window, scale=0.25)
        assert torch.isfinite(got).all(), (dtype, window, max_splits)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_prefill_is_attention_triton():
    q, cache, meta = _case([3, 0], [9, 20], heads=4, kv_heads=2, hd=16, page=8, window=12, dtype=torch.bfloat16)
    want = available("attention", "triton").at(SMALL)(q, cache, meta, window=12, scale=0.25)
    got = available("attention", "triton_widemerge").at(dict(SMALL, MERGE_BLOCK_D=8))(q, cache, meta, window=12,
                                                                                       scale=0.25)
    assert torch.equal(got, want)


def test_more_splits_than_one_merge_tile_is_refused_by_name(monkeypatch):
    from workbench.variants.kernels import attention_widemerge as wide

    q, cache, meta = _case([200], [1], heads=2, kv_heads=1, hd=16, page=8, window=None, dtype=torch.float32)
    cfg = dict(SMALL, BLOCK_N=16, WAVES=10 ** 6, MAX_SPLITS=10 ** 6, MERGE_BLOCK_D=8)
    monkeypatch.setattr(wide, "MAX_MERGE_SPLITS", 4)
    with pytest.raises(ValueError, match="merges at most 4 splits"):
        available("attention", "triton_widemerge").at(cfg)(q, cache, meta, window=None, scale=0.25)


# ---- on the GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("window", [None, 512])
def test_gpu_decode_graph_replay_with_new_lengths(window):
    v = registry.get("attention", "triton_widemerge")
    for config in v.configs:
        check_graph_replay(v.at(dict(config, pdl=True)), window, poison=True, label=f"triton_widemerge {config}")
