"""`attention:triton` (split-K paged decode, flash prefill) against the torch reference.

On the CPU the kernels run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET), so
caches are hand-built at tiny shapes with small pages: contexts cross page boundaries, windows are
smaller than a page or span several, batches mix lengths, and everything a kernel must not read
(pages not in the table, -1 holes of released sliding pages, rows past a sequence's length, keys
before the window) holds NaN, so a read that leaks shows up as a NaN output. Every tuning config is
checked, since each is a separately compiled kernel. The `gpu` test replays a decode step in a
CUDA graph with new lengths, as the server does. (The op gate, every config, CPU and GPU shapes:
test_every_variant.py.)
"""

import dataclasses

import pytest
import torch

from tests.variants.attention_cases import _assert_close, _case, check_graph_replay
from tests.variants.helpers import (
    available,
    callables,
    failures,
    needs_cuda,
)
from workbench import gates, registry
from workbench.points import Workload


def _run_all(q, cache, meta, window, extra=(), label=""):
    v, ref = available("attention", "triton"), registry.reference("attention")
    scale = q.shape[-1] ** -0.5
    want = ref.fn(q, cache, meta, window=window, scale=scale)
    q0, cache0, table0 = q.clone(), cache.clone(), meta.page_table.clone()
    for name, fn in callables(v, extra):
        _assert_close(fn(q, cache, meta, window=window, scale=scale), want, f"{label} {name}")
    assert torch.equal(q, q0) and torch.equal(cache.isnan(), cache0.isnan()), "inputs modified"
    assert torch.equal(cache.nan_to_num(), cache0.nan_to_num()) and torch.equal(meta.page_table, table0)


DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(4, 2, 16), (6, 1, 32)]  # (heads, kv_heads, head_dim): beam-tiny's GQA 2:1, TP8's 6:1
# Small blocks and many splits, so tiny contexts still cross blocks, splits and empty splits.
SMALL = [dict(BLOCK_N=16, MIN_BLOCKS=1, WAVES=64, MAX_SPLITS=8, num_warps=2, num_stages=1,
              PREFILL_BLOCK_M=16, PREFILL_BLOCK_N=16, PREFILL_WARPS=2, PREFILL_STAGES=1, FUSED_MERGE_MAX_SPLITS=0)]
SMALL += [dict(SMALL[0], FUSED_MERGE_MAX_SPLITS=8)]  # the last split program merges


# ---- decode -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 5, 12], ids=["full", "win5", "win12"])
@pytest.mark.parametrize("heads,kv_heads,hd", SHAPES, ids=["gqa4-2", "gqa6-1"])
def test_decode(heads, kv_heads, hd, window, dtype):
    """Mixed lengths (1 token, mid-page, exact page end, long), page 8: windows inside and across pages."""
    ctx = [0, 12, 31, 69]
    q, cache, meta = _case(ctx, [1] * len(ctx), heads=heads, kv_heads=kv_heads, hd=hd, page=8, window=window,
                           dtype=dtype, seed=heads + (window or 0))
    _run_all(q, cache, meta, window, SMALL, label=f"decode w={window}")


@pytest.mark.parametrize("window", [None, 12], ids=["full", "win12"])
def test_decode_fp16(window):
    """FP16 takes the two-term probability split (scaled clear of FP16 subnormals)."""
    ctx = [3, 47, 200]
    q, cache, meta = _case(ctx, [1] * 3, heads=6, kv_heads=1, hd=16, page=8, window=window, dtype=torch.float16)
    _run_all(q, cache, meta, window, SMALL, label=f"fp16 decode w={window}")


def test_decode_ignores_host_copies_and_reads_lengths_on_the_device():
    """A captured decode step's host copies are placeholders (the server's graphs hold seq_lens_host
    [1]*b): decode must take lengths and positions from the device tensors only."""
    q, cache, meta = _case([40, 9], [1, 1], heads=4, kv_heads=2, hd=16, page=8, window=12, dtype=torch.bfloat16)
    stale = dataclasses.replace(meta, seq_lens_host=[1, 1], query_start_host=[0, 1, 2])
    want = registry.reference("attention").fn(q, cache, meta, window=12, scale=0.25)
    for name, fn in callables(available("attention", "triton"), SMALL):
        _assert_close(fn(q, cache, stale, window=12, scale=0.25), want, name)


def test_decode_splits_follow_shapes_not_lengths():
    from workbench.variants.kernels.attention import DEFAULT, decode_splits

    cfg = dict(DEFAULT, BLOCK_N=64, MIN_BLOCKS=1, WAVES=2, MAX_SPLITS=256)
    cpu = torch.device("cpu")  # 4 "SMs" under the interpreter
    assert decode_splits(1, 1, 512, 64, None, cfg, cpu) == 8  # 32K context: two waves over the SMs
    assert decode_splits(1, 1, 512, 64, 512, cfg, cpu) == 8   # 512-window: 9 blocks, 8 programs wanted
    assert decode_splits(1, 1, 512, 64, 16, cfg, cpu) == 2    # window inside a page: at most 2 blocks
    assert decode_splits(64, 1, 512, 64, None, cfg, cpu) == 1
    assert decode_splits(1, 1, 512, 64, None, dict(cfg, MIN_BLOCKS=128), cpu) == 4


def test_decode_merge_over_head_dim_blocks_and_split_chunks(monkeypatch):
    """The merge runs one program per MERGE_BLOCK_D columns of head_dim (here 64: two) and walks the
    splits MERGE_MAX_SPLITS at a time (forced to 2 here, so 8 splits take four chunks)."""
    from workbench.variants.kernels import attention as _triton_attention

    monkeypatch.setattr(_triton_attention, "MERGE_MAX_SPLITS", 2)
    q, cache, meta = _case([70, 33], [1, 1], heads=2, kv_heads=1, hd=64, page=8, window=None, dtype=torch.bfloat16)
    _run_all(q, cache, meta, None, SMALL, label="merge chunks")


def test_fused_merge_leaves_its_counters_at_zero():
    """The last split program resets its (sequence, kv head) counter: the next call, with no memset in
    between, merges right again (and the cached counters stay all zero)."""
    from workbench.variants.kernels import arrivals as _arrivals

    q, cache, meta = _case([70, 5, 33], [1] * 3, heads=4, kv_heads=2, hd=16, page=8, window=None,
                           dtype=torch.bfloat16)
    for _ in range(2):
        _run_all(q, cache, meta, None, SMALL[1:], label="fused merge")
    assert not _arrivals.COUNTERS[(q.device, "attention")].any()


def test_fused_and_separate_merges_give_the_same_bits():
    """Both merges run `merge_head` over one tile of a head's splits, so where the last split program
    merges (FUSED_MERGE_MAX_SPLITS) the output is bitwise the separate merge kernel's."""
    q, cache, meta = _case([70, 5, 33], [1] * 3, heads=6, kv_heads=1, hd=32, page=8, window=12,
                           dtype=torch.bfloat16)
    v = available("attention", "triton")
    separate, fused = v.at(SMALL[0]), v.at(SMALL[1])
    assert torch.equal(fused(q, cache, meta, window=12, scale=0.25), separate(q, cache, meta, window=12, scale=0.25))


def test_early_v_gives_the_same_bits():
    """EARLY_V only moves each block's V load before the scores: the arithmetic, so the bits, stay."""
    v = available("attention", "triton")
    late, early = v.at(SMALL[0]), v.at(dict(SMALL[0], EARLY_V=True))
    for window in (None, 12):
        q, cache, meta = _case([70, 5, 33], [1] * 3, heads=6, kv_heads=1, hd=32, page=8, window=window,
                               dtype=torch.bfloat16)
        want = late(q, cache, meta, window=window, scale=0.25)
        assert not want.isnan().any() and torch.equal(early(q, cache, meta, window=window, scale=0.25), want)


def test_decode_padded_graph_rows():
    """Rows padded into a captured batch: position 0, length 1, a table of zeros (the reserved page 0)."""
    q, cache, meta = _case([20, 0], [1, 1], heads=4, kv_heads=2, hd=16, page=8, window=None, dtype=torch.bfloat16)
    meta.page_table[1] = 0
    cache[0] = torch.randn(cache[0].shape).to(cache.dtype)
    _run_all(q, cache, meta, None, SMALL, label="padded")


# ---- prefill ----------------------------------------------------------------------------------

# Each shape meets each window and dtype once (the interpreter makes the full product slow).
PREFILL_CASES = [(SHAPES[0], None, torch.float32), (SHAPES[0], 5, torch.bfloat16), (SHAPES[0], 12, torch.float16),
                 (SHAPES[1], None, torch.bfloat16), (SHAPES[1], 5, torch.float32), (SHAPES[1], 12, torch.bfloat16)]


@pytest.mark.parametrize("shape,window,dtype", PREFILL_CASES,
                         ids=[f"gqa{s[0]}-{s[1]}-w{w}-{str(d)[6:]}" for s, w, d in PREFILL_CASES])
def test_prefill(shape, window, dtype):
    """A ragged batch: a fresh prompt, a chunk after context, a one-token chunk and a 37-token chunk
    (three 16-row query blocks in the SMALL config), page 8."""
    ctx, new = [0, 13, 22, 30], [6, 9, 1, 37]
    heads, kv_heads, hd = shape
    q, cache, meta = _case(ctx, new, heads=heads, kv_heads=kv_heads, hd=hd, page=8, window=window, dtype=dtype,
                           seed=hd + (window or 0))
    assert not meta.decode
    _run_all(q, cache, meta, window, SMALL, label=f"prefill w={window}")


def test_prefill_head_dim_not_a_power_of_two():
    q, cache, meta = _case([5, 0], [7, 3], heads=4, kv_heads=2, hd=24, page=4, window=6, dtype=torch.bfloat16)
    _run_all(q, cache, meta, 6, SMALL, label="hd24 prefill")
    q, cache, meta = _case([5, 30], [1, 1], heads=4, kv_heads=2, hd=24, page=4, window=None, dtype=torch.bfloat16)
    _run_all(q, cache, meta, None, SMALL, label="hd24 decode")


# ---- registration and the op gate ------------------------------------------------------------

def test_default_is_first_config_and_supports():
    from workbench.variants.kernels.attention import DEFAULT
    from workbench.variants.kernels.attention_configs import TRITON_CONFIGS

    v = registry.get("attention", "triton")
    assert v.backend == "triton" and v.configs is TRITON_CONFIGS and v.configs[0] == DEFAULT
    assert all(set(cfg) == set(DEFAULT) and cfg["BLOCK_N"] >= 16 and cfg["PREFILL_BLOCK_M"] >= 16
               and cfg["PREFILL_BLOCK_N"] >= 16 for cfg in v.configs)  # tl.dot dims >= 16 on the GPU
    for preset in ("beam-tiny", "beam-501b-tp8", "beam-501b", "beam-small"):
        for dtype in ("bf16", "fp16", "fp32"):
            assert v.supports(Workload(preset, dtype=dtype)) is True
    assert isinstance(v.supports(Workload("beam-tiny", dtype="fp8")), str)


WORKLOADS = [w.with_(layer=k) for w in (Workload(batch=2, context=1000), Workload(batch=2, tokens_per_seq=20,
                                                                                  context=100))
             for k in ("sliding", "full")]  # test_gates.py's decode and prefill, both layer kinds


def test_op_gate_fp32():
    fp32 = [w.with_(dtype="fp32") for w in WORKLOADS[::3]]
    report = gates.op_gate(available("attention", "triton"), fp32, seeds=(1,))
    assert report.passed, failures(report)


# ---- on the GPU: the op gate at beam-501b-tp8 shapes, and a CUDA-graph replay ----------------------



@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("window", [None, 512])
def test_gpu_decode_graph_replay_with_new_lengths(window):
    """Capture a TP8 decode step, then write other lengths, positions, pages and K/V into the same
    tensors and replay: the output must follow the new contents (nothing read on the host at capture)."""
    for name, fn in callables(registry.get("attention", "triton")):
        check_graph_replay(fn, window, poison=True, label=name)
