"""`attention:flashinfer`: our page table turned into FlashInfer's page lists, and the planning rules.

On the CPU, flashinfer is replaced by a stand-in that implements its documented semantics from the
page lists alone (a request's keys are its listed pages, cut to (pages - 1) * page_size +
last_page_len; its queries sit at the end of its keys; `window_left` keys before each query stay
visible), reading every row of the listed pages up to that length, masked or not, as a real kernel
does. NaN sits in released pages and past each sequence's length, so a list that starts too early,
holds a -1 or runs too long shows up as NaN or as a wrong output. The stand-in also records plans,
so the tests check when the variant plans (once per metadata, again on `Ops.replan`). The `gpu` test
runs the real library: a captured decode step replayed after `replan` with new lengths, as the server
does (test_every_variant.py gates it at beam-501b-tp8 shapes).
"""

import sys
import types

import pytest
import torch

from beam_model.config import BeamConfig
from beam_model.kv_cache import StepMetadata
from beam_model.model import BeamForCausalLM
from tests.variants.attention_cases import _assert_close, _case, check_graph_replay
from tests.variants.helpers import callables
from workbench import registry
from workbench.points import Workload

MODULE = "workbench.variants.kernels.flashinfer_attention"


def _attend(q, keys, values, q_pos, window_left, scale):
    """q [n, Hq, D] at key positions q_pos; keys/values [J, Hkv, D] -> [n, Hq, D] FP32."""
    j = torch.arange(keys.shape[0])
    visible = j[None, :] <= q_pos[:, None]
    if window_left >= 0:
        visible &= j[None, :] >= q_pos[:, None] - window_left
    group = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, 1)
    v = values.float().repeat_interleave(group, 1)
    s = torch.einsum("nhd,jhd->nhj", q.float(), k) * scale
    p = s.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    return torch.einsum("nhj,jhd->nhd", p, v)  # 0 * NaN = NaN: rows are not masked at the load


class _Wrapper:
    plans: list = []

    def __init__(self, workspace, layout, **kw):
        assert layout == "NHD"
        self.kw = kw

    def _lists(self, indptr, indices, last):
        assert indptr.device.type == "cpu" and last.device.type == "cpu", "host lists expected"
        assert (indices >= 0).all(), f"page list holds a page not held: {indices.tolist()}"
        self.indptr, self.last = indptr.tolist(), last.tolist()
        self._paged_kv_indices_buf = self.indices = indices  # kept, not copied, and read at run time

    def _keys(self, cache, b):
        pages = self.indices.cpu()[self.indptr[b]:self.indptr[b + 1]].long()
        assert (pages >= 0).all(), f"page list holds a page not held: {pages.tolist()}"
        kv_len = (len(pages) - 1) * cache.shape[2] + self.last[b]
        kv = cache[pages]  # [P, 2, ps, H, D]
        k = kv[:, 0].reshape(-1, *cache.shape[3:])[:kv_len]
        v = kv[:, 1].reshape(-1, *cache.shape[3:])[:kv_len]
        return k, v, kv_len


class _Decode(_Wrapper):
    def plan(self, indptr, indices, last, heads, kv_heads, head_dim, page_size, *, window_left, sm_scale, **kw):
        self._lists(indptr, indices, last)
        self.window_left, self.scale = window_left, sm_scale
        _Wrapper.plans.append(("decode", window_left, list(self.indptr)))

    def run(self, q, cache):
        out = []
        for b in range(q.shape[0]):
            k, v, n = self._keys(cache, b)
            out.append(_attend(q[b:b + 1], k, v, torch.tensor([n - 1]), self.window_left, self.scale))
        return torch.cat(out).to(q.dtype)


class _Prefill(_Wrapper):
    def plan(self, qo_indptr, indptr, indices, last, heads, kv_heads, head_dim, page_size, *, causal,
             window_left, sm_scale, **kw):
        assert causal and qo_indptr.device.type == "cpu"
        self._lists(indptr, indices, last)
        self.qo, self.window_left, self.scale = qo_indptr.tolist(), window_left, sm_scale
        _Wrapper.plans.append(("prefill", window_left, list(self.indptr)))

    def run(self, q, cache, out=None):
        if out is None:
            out = torch.zeros_like(q)  # FlashInfer 0.7's own output
        else:  # as FlashInfer checks a given one
            assert out.shape == (*q.shape[:-1], cache.shape[-1]) and out.dtype == q.dtype, (out.shape, out.dtype)
        for b in range(len(self.qo) - 1):
            k, v, n = self._keys(cache, b)
            rows = slice(self.qo[b], self.qo[b + 1])
            m = self.qo[b + 1] - self.qo[b]
            pos = torch.arange(n - m, n)
            out[rows] = _attend(q[rows], k, v, pos, self.window_left, self.scale).to(q.dtype)
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch):
    fake = types.ModuleType("flashinfer")
    fake.BatchDecodeWithPagedKVCacheWrapper = _Decode
    fake.BatchPrefillWithPagedKVCacheWrapper = _Prefill
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.delitem(sys.modules, MODULE, raising=False)  # import it afresh against the stand-in
    _Wrapper.plans = []
    yield _Wrapper.plans
    sys.modules.pop(MODULE, None)


@pytest.mark.parametrize("window", [None, 5, 12], ids=["full", "win5", "win12"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_page_lists(fake_flashinfer, window, dtype):
    q, cache, meta = _case([0, 7, 8, 40, 17], [1] * 5, heads=6, kv_heads=1, hd=16, page=8, window=window,
                           dtype=dtype, poison_window=False)
    want = registry.reference("attention").fn(q, cache, meta, window=window, scale=0.25)
    for name, fn in callables(registry.get("attention", "flashinfer")):
        _assert_close(fn(q, cache, meta, window=window, scale=0.25), want, f"decode {window} {name}")


@pytest.mark.parametrize("window", [None, 5, 12], ids=["full", "win5", "win12"])
def test_prefill_page_lists(fake_flashinfer, window):
    q, cache, meta = _case([0, 9, 30, 16], [5, 12, 3, 20], heads=4, kv_heads=2, hd=16, page=8, window=window,
                           dtype=torch.bfloat16, poison_window=False)
    want = registry.reference("attention").fn(q, cache, meta, window=window, scale=0.25)
    for name, fn in callables(registry.get("attention", "flashinfer")):
        _assert_close(fn(q, cache, meta, window=window, scale=0.25), want, f"prefill {window} {name}")


def test_plans_once_per_metadata_and_again_on_replan(fake_flashinfer):
    plans = fake_flashinfer
    fn = registry.get("attention", "flashinfer").fn
    q, cache, meta = _case([20, 3], [1, 1], heads=4, kv_heads=2, hd=16, page=8, window=None, dtype=torch.bfloat16)
    for _ in range(3):  # the layers of one group share the step's metadata: one plan
        fn(q, cache, meta, window=None, scale=0.25)
    fn(q, cache, meta, window=5, scale=0.25)  # another window (the sliding group): its own wrapper
    assert [p[:2] for p in plans] == [("decode", -1), ("decode", 4)]
    # A graph runner refills the same metadata (one more token each) and asks for a replan.
    _, cache2, meta2 = _case([21, 4], [1, 1], heads=4, kv_heads=2, hd=16, page=8, window=None, dtype=torch.bfloat16)
    meta.page_table.copy_(meta2.page_table)
    meta.seq_lens.copy_(meta2.seq_lens)
    meta.positions.copy_(meta2.positions)
    meta.seq_lens_host[:] = meta2.seq_lens_host
    fn.replan(meta)
    assert [p[1:] for p in plans[2:]] == [(-1, [0, 3, 4]), (4, [0, 1, 2])]  # both of its wrappers
    want = registry.reference("attention").fn(q, cache2, meta, window=None, scale=0.25)
    _assert_close(fn(q, cache2, meta, window=None, scale=0.25), want, "after replan")
    assert len(plans) == 4  # the replanned wrapper is used as is
    model = BeamForCausalLM(BeamConfig.from_preset("beam-tiny"))  # the model's hook reaches the bound variant
    model.ops = types.SimpleNamespace(**{p: registry.reference(p).fn for p in registry.POINTS})
    model.replan(StepMetadata(groups={"full": meta}, positions=meta.positions, last_token_index=None,
                              num_tokens=2))
    assert len(plans) == 4  # references plan nothing
    model.ops.attention = fn
    model.replan(StepMetadata(groups={"full": meta}, positions=meta.positions, last_token_index=None,
                              num_tokens=2))
    assert len(plans) == 6


def test_prefill_plans_per_layout_and_reads_the_pages_on_every_call(fake_flashinfer):
    """Two steps with one layout but other pages (rotated copies in the bench; two prompts of the same
    lengths in the server): one plan, and each call reads its own step's pages."""
    plans = fake_flashinfer
    fn = registry.get("attention", "flashinfer").fn
    ref = registry.reference("attention").fn
    args = dict(heads=4, kv_heads=2, hd=16, page=8, window=5, dtype=torch.bfloat16, poison_window=False)
    steps = [_case([9, 30], [12, 3], seed=seed, **args) for seed in (0, 1)]
    assert not torch.equal(steps[0][2].page_table, steps[1][2].page_table)
    for _ in range(2):
        for i, (q, cache, meta) in enumerate(steps):
            _assert_close(fn(q, cache, meta, window=5, scale=0.25), ref(q, cache, meta, window=5, scale=0.25),
                          f"step {i}")
    assert len(plans) == 1
    q, cache, meta = _case([9, 31], [12, 3], seed=2, **args)  # another layout: planned again
    _assert_close(fn(q, cache, meta, window=5, scale=0.25), ref(q, cache, meta, window=5, scale=0.25), "new layout")
    assert len(plans) == 2


def test_prefill_replans_per_step_if_the_library_copies_the_indices(fake_flashinfer, monkeypatch):
    plans = fake_flashinfer
    monkeypatch.setattr(_Prefill, "_lists", lambda self, indptr, indices, last: _Wrapper._lists(
        self, indptr, indices.clone(), last))  # a library that snapshots the indices at plan time
    fn = registry.get("attention", "flashinfer").fn
    ref = registry.reference("attention").fn
    args = dict(heads=4, kv_heads=2, hd=16, page=8, window=None, dtype=torch.bfloat16, poison_window=False)
    steps = [_case([9, 30], [12, 3], seed=seed, **args) for seed in (0, 1)]
    for i, (q, cache, meta) in enumerate(steps):
        _assert_close(fn(q, cache, meta, window=None, scale=0.25), ref(q, cache, meta, window=None, scale=0.25),
                      f"step {i}")
    assert len(plans) == 2


def test_wrapper_dies_with_its_metadata(fake_flashinfer):
    import gc

    fn = registry.get("attention", "flashinfer").fn
    q, cache, meta = _case([20], [1], heads=4, kv_heads=2, hd=16, page=8, window=None, dtype=torch.bfloat16)
    fn(q, cache, meta, window=None, scale=0.25)
    module = sys.modules[MODULE]
    assert len(module._decode) == 1
    del meta
    gc.collect()
    assert module._decode == {}


def test_supports_and_unavailable_without_the_library():
    v = registry.get("attention", "flashinfer")
    assert v.backend == "flashinfer" and v.fn.replan is not None
    assert v.supports(Workload("beam-501b-tp8", dtype="bf16")) is True
    assert "fp32" in v.supports(Workload("beam-501b-tp8", dtype="fp32"))
    assert "head_dim" in v.supports(Workload("beam-tiny", dtype="bf16"))  # head_dim 16
    ok, why = registry.backend_available("flashinfer")
    if not ok:
        assert "flashinfer" in why and v.unsupported() == why


# ---- on the GPU, the real library -----------------------------------------------------------------

needs_flashinfer = pytest.mark.skipif(not registry.backend_available("flashinfer")[0],
                                      reason="needs flashinfer and a CUDA GPU")


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("window", [None, 512])
def test_gpu_decode_graph_replay_after_replan(window):
    """Capture a TP8 decode step, refill its tensors and host lengths with another step, replan,
    replay: the output must follow the new contents."""
    v = registry.get("attention", "flashinfer")
    for cfg in v.configs:
        fn = v.at(cfg)
        check_graph_replay(fn, window, poison=False, before_replay=fn.replan, label=str(cfg))
