"""`attention:triton_prefetch`: attention:triton's decode with each split's first key block loaded
before the PDL wait. It repeats attention:triton's arithmetic, so at the same config the output is
bitwise attention:triton's (on the CPU interpreter, where PDL is off, that is what is checked, over
the NaN-poisoned cases of attention_cases.py). On the GPU: a CUDA-graph replay with new contents,
and the one thing the interpreter cannot show: with PDL, the query's own K/V row is read only after
the kernel before (which writes it) has finished. A planted fault that reads it early must fail that
test. (The op gate, every config: test_every_variant.py.)
"""

import pytest
import torch

from tests.variants.attention_cases import NAN, _case, check_graph_replay
from tests.variants.helpers import available, needs_cuda
from workbench import registry

# As tests/variants/test_triton_attention.py's SMALL: tiny blocks, so small contexts cross blocks and splits;
# MAX_SPLITS 8: one block a split and empty splits; MAX_SPLITS 2: several blocks a split (the loop
# after the prefetched block).
SMALL = dict(BLOCK_N=16, MIN_BLOCKS=1, WAVES=64, MAX_SPLITS=8, num_warps=2, num_stages=1, PREFILL_BLOCK_M=16,
             PREFILL_BLOCK_N=16, PREFILL_WARPS=2, PREFILL_STAGES=1, FUSED_MERGE_MAX_SPLITS=0, EARLY_V=False)


@pytest.mark.parametrize("max_splits,prefetch_v", [(8, True), (2, True), (8, False)])
@pytest.mark.parametrize("window", [None, 12], ids=["full", "win12"])
def test_decode_gives_attention_triton_bits(window, max_splits, prefetch_v):
    prefetch, triton_ = available("attention", "triton_prefetch"), available("attention", "triton")
    cfg = dict(SMALL, MAX_SPLITS=max_splits)
    for dtype in (torch.bfloat16, torch.float32):
        q, cache, meta = _case([70, 5, 33, 0], [1] * 4, heads=6, kv_heads=1, hd=32, page=8, window=window,
                               dtype=dtype)
        want = triton_.at(cfg)(q, cache, meta, window=window, scale=0.25)
        got = prefetch.at(dict(cfg, PREFETCH_V=prefetch_v))(q, cache, meta, window=window, scale=0.25)
        assert torch.isfinite(want).all() and torch.equal(got, want), (dtype, window, max_splits, prefetch_v)


def test_prefill_is_attention_triton():
    q, cache, meta = _case([3, 0], [9, 20], heads=4, kv_heads=2, hd=16, page=8, window=12, dtype=torch.bfloat16)
    want = available("attention", "triton").at(SMALL)(q, cache, meta, window=12, scale=0.25)
    assert torch.equal(available("attention", "triton_prefetch").at(SMALL)(q, cache, meta, window=12, scale=0.25), want)


def test_configs_are_the_separate_merge_forms():
    v = registry.get("attention", "triton_prefetch")
    assert v.configs and all(not c["FUSED_MERGE_MAX_SPLITS"] and not c["EARLY_V"] for c in v.configs)
    base = [{k: x for k, x in c.items() if k != "PREFETCH_V"} for c in v.configs]
    assert all(c in registry.get("attention", "triton").configs for c in base)
    assert any(c.get("PREFETCH_V") is False for c in v.configs)


# ---- on the GPU ---------------------------------------------------------------------------------


def _config(v, block_n, prefetch_v=True):
    """The variant's config at `block_n` keys a block, 1 stage, holding K and V (or only K) across the wait."""
    return next(c for c in v.configs if c["BLOCK_N"] == block_n and c["num_stages"] == 1
                and c.get("PREFETCH_V", True) == prefetch_v)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("window", [None, 512])
def test_gpu_decode_graph_replay_with_new_lengths(window):
    v = registry.get("attention", "triton_prefetch")
    fn = v.at(dict(_config(v, 128), pdl=True))
    check_graph_replay(fn, window, poison=True, label="triton_prefetch")


def _slow_writer():
    import triton
    import triton.language as tl

    from workbench.variants.kernels.triton_common import pdl_release

    @triton.jit
    def _write_late(src_ptr, k_ptr, v_ptr, n, spins, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """Let the next kernel start, spin, then write the K and V rows (as qk_prep writes the new token's)."""
        pdl_release(PDL)
        acc = 0.0
        for _ in range(spins):
            acc = acc * 0.5 + 1.0
        offs = tl.arange(0, BLOCK)
        ok = offs < n
        tl.store(k_ptr + offs, tl.load(src_ptr + offs, mask=ok) + acc * 0.0, mask=ok)
        tl.store(v_ptr + offs, tl.load(src_ptr + n + offs, mask=ok) + acc * 0.0, mask=ok)

    return _write_late


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("prefetch_v", [True, False], ids=["k-and-v", "k-only"])
@pytest.mark.parametrize("context", [4096, 32768])
def test_gpu_own_key_read_after_the_wait(context, prefetch_v):
    """In a CUDA graph, a kernel that releases PDL at once and writes the query's own K/V row only after
    a long spin, then the decode with PDL: the decode must see the row written (the reference on the
    final cache), where the row held NaN before. The planted fault (the own row loaded before the
    wait) must not: it reads the NaN, which proves the decode did start during the spin."""
    from workbench.variants.kernels.attention_prefetch import paged_attention
    from workbench.variants.kernels.triton_common import pdl_launch

    dev, hd = torch.device("cuda"), 128
    q, cache, meta = _case([context - 1], [1], heads=6, kv_heads=1, hd=hd, page=64, window=None,
                           dtype=torch.bfloat16, device=dev)
    pos = context - 1
    page = int(meta.page_table[0, pos // 64])
    row = cache[page, :, pos % 64, 0].clone()  # [2, hd]: the own K and V
    write = _slow_writer()
    cfg = dict(_config(registry.get("attention", "triton_prefetch"), 128, prefetch_v), pdl=True)
    want = registry.reference("attention").fn(q, cache, meta, window=None, scale=hd ** -0.5)
    outs = {}
    for after_wait in (True, False):
        def step():
            write[(1,)](row, cache[page, 0, pos % 64, 0], cache[page, 1, pos % 64, 0], hd, 200000, BLOCK=hd,
                        **pdl_launch(True))
            return paged_attention(q, cache, meta, window=None, scale=hd ** -0.5, config=cfg,
                                   own_key_after_wait=after_wait)
        step()  # compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        cache[page, :, pos % 64, 0] = NAN
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(cache[page, :, pos % 64, 0], row)
        outs[after_wait] = out.clone()
    err = ((outs[True].float() - want.float()).norm() / want.float().norm()).item()
    assert torch.isfinite(outs[True]).all() and err <= 6e-3, err
    assert not torch.isfinite(outs[False]).all(), "the planted early read saw the written row: no overlap to test"
