"""The paged KV cache: bookkeeping, and model steps through it agreeing with a one-shot prefill.

beam-tiny (window 16, pages of 64 tokens) in FP32; `model(ids)` is the no-cache reference.
"""

import pytest
import torch

from beam_model.config import FULL, SLIDING, BeamConfig
from beam_model.functional import apply_rope, rms_norm, rope_cos_sin
from beam_model.kv_cache import PAGE_SIZE, CacheFull, PagedKVCache
from beam_model.model import BeamForCausalLM

TINY = BeamConfig.from_preset("beam-tiny")
W = TINY.sliding_window


@pytest.fixture(scope="module")
def model():
    return BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32, seed=0)


def tokens(n, seed):
    return torch.randint(0, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def assert_logits_close(got, ref, rel=1e-4):
    assert got.shape == ref.shape
    assert torch.isfinite(got).all()
    err = (got - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item(), f"max abs diff {err:.3g} vs max |logit| {ref.abs().max().item():.3g}"


def new_cache(num_pages=32, **kw):
    return PagedKVCache(TINY, num_pages, dtype=torch.float32, **kw)


@torch.inference_mode()
def run(model, cache, seq_ids, chunks, all_logits=False):
    """One engine step: `chunks` are the new token tensors of each sequence."""
    step = cache.prepare_step(list(seq_ids), [len(c) for c in chunks])
    return model.step(torch.cat(list(chunks)), cache, step, all_logits=all_logits)


# ------------------------------------------------------------------ prefill + decode == prefill

def test_prefill_then_batched_decode_equals_full_prefill(model):
    lengths, k = [70, 20, 41, 9], 8
    # decode crosses the 64-token page boundary (62 -> 69) and the window (12 -> 19)
    assert (lengths[0] - k) < PAGE_SIZE <= lengths[0] - 1
    assert (lengths[1] - k) < W <= lengths[1] - 1
    seqs = [tokens(n, seed=i) for i, n in enumerate(lengths)]
    full = [model(s) for s in seqs]
    cache = new_cache()
    for i, s in enumerate(seqs):
        cache.add(i)
    # prefill all four together in one ragged step
    prefill = run(model, cache, range(4), [s[: len(s) - k] for s in seqs])
    for i, s in enumerate(seqs):
        assert_logits_close(prefill[i], full[i][len(s) - k - 1])
    for j in range(k):
        step = cache.prepare_step([0, 1, 2, 3], [1, 1, 1, 1])
        assert step.groups[FULL].decode and step.groups[SLIDING].decode
        with torch.inference_mode():
            out = model.step(torch.stack([s[len(s) - k + j] for s in seqs]), cache, step)
        assert out.shape == (4, TINY.vocab_size)
        for i, s in enumerate(seqs):
            assert_logits_close(out[i], full[i][len(s) - k + j])
    assert [cache.length(i) for i in range(4)] == lengths


def test_batched_forward_equals_single(model):
    a, b = tokens(30, 1), tokens(30, 2)
    both = model(torch.stack([a, b]))
    assert both.shape == (2, 30, TINY.vocab_size)
    assert_logits_close(both[0], model(a))
    assert_logits_close(both[1], model(b))


@pytest.mark.parametrize("split", [[40, 60], [63, 1, 36], [5, 90, 5]])
def test_chunked_prefill_equals_one_prefill(model, split):
    ids = tokens(sum(split), seed=7)
    full = model(ids)
    cache = new_cache()
    cache.add("s")
    start = 0
    for n in split:
        out = run(model, cache, ["s"], [ids[start:start + n]], all_logits=True)
        assert out.shape == (n, TINY.vocab_size)
        assert_logits_close(out, full[start:start + n])
        start += n


def test_mixed_prefill_and_decode_steps(model):
    a, b, c = tokens(90, 11), tokens(75, 12), tokens(30, 13)
    full = {"a": model(a), "b": model(b), "c": model(c)}
    cache = new_cache()
    for s in "abc":
        cache.add(s)
    run(model, cache, ["a"], [a[:60]])
    # a decodes while b prefills its first chunk
    step = cache.prepare_step(["a", "b"], [1, 40])
    assert not step.groups[FULL].decode
    assert step.last_token_index.tolist() == [0, 40]
    with torch.inference_mode():
        out = model.step(torch.cat([a[60:61], b[:40]]), cache, step)
    assert_logits_close(out[0], full["a"][60])
    assert_logits_close(out[1], full["b"][39])
    # b's second chunk, a decodes, c starts: three kinds in one step
    out = run(model, cache, ["b", "a", "c"], [b[40:70], a[61:62], c[:20]])
    assert_logits_close(out[0], full["b"][69])
    assert_logits_close(out[1], full["a"][61])
    assert_logits_close(out[2], full["c"][19])
    # everyone decodes; then a and c only
    for j in range(5):
        out = run(model, cache, ["a", "b", "c"], [a[62 + j:63 + j], b[70 + j:71 + j], c[20 + j:21 + j]])
        for i, (s, pos) in enumerate([("a", 62 + j), ("b", 70 + j), ("c", 20 + j)]):
            assert_logits_close(out[i], full[s][pos])
    out = run(model, cache, ["c", "a"], [c[25:30], a[67:68]], all_logits=True)
    assert_logits_close(out[:5], full["c"][25:30])
    assert_logits_close(out[5], full["a"][67])


# ------------------------------------------------------------------ sliding-window page release

def _decode_all(model, cache, ids, prompt):
    cache.add(0)
    outs = [run(model, cache, [0], [ids[:prompt]])[0]]
    for t in range(prompt, len(ids)):
        outs.append(run(model, cache, [0], [ids[t:t + 1]])[0])
    return torch.stack(outs)


def test_release_window_gives_the_same_logits(model):
    ids = tokens(200, seed=21)
    prompt = 30
    with_release = _decode_all(model, new_cache(release_window=True), ids, prompt)
    without = _decode_all(model, new_cache(release_window=False), ids, prompt)
    torch.testing.assert_close(with_release, without, rtol=1e-6, atol=1e-6)
    assert_logits_close(with_release, model(ids)[prompt - 1:])


def test_released_pages_go_back_to_the_pool(model):
    ids = tokens(200, seed=22)
    cache = new_cache(num_pages=8, num_sliding_pages=8)
    cache.add(0)
    run(model, cache, [0], [ids[:60]])
    free0 = cache.free_pages(SLIDING)
    assert cache.used_pages(SLIDING) == 1 and cache.used_pages(FULL) == 1
    released_at = None
    for t in range(60, 200):
        before = cache.free_pages(SLIDING)
        grows = t % PAGE_SIZE == 0  # the token at t needs a new page
        run(model, cache, [0], [ids[t:t + 1]])
        first_visible = t - W + 1  # of the token just decoded (position t)
        pages = cache.pages(0, SLIDING)
        # a page is released exactly when all of it is older than the window
        released = [(i + 1) * PAGE_SIZE <= first_visible for i in range(len(pages))]
        assert [p == -1 for p in pages] == released, (t, pages)
        newly = sum(released) - sum((i + 1) * PAGE_SIZE <= first_visible - 1 for i in range(len(pages)))
        assert cache.free_pages(SLIDING) == before + newly - grows, t
        if newly and released_at is None:
            released_at = t
    # page 0 (positions 0..63) leaves when the query at 79 no longer sees 63; page 1 at 143
    assert released_at == PAGE_SIZE + W - 1
    pages = cache.pages(0, SLIDING)
    assert pages[:2] == [-1, -1] and pages[2] > 0
    assert cache.used_pages(SLIDING) == 2  # positions 128..199 span pages 2 and 3
    assert cache.free_pages(SLIDING) == 7 - 2 and free0 == 7 - 1
    assert -1 not in cache.pages(0, FULL) and cache.used_pages(FULL) == 4  # full layers keep all
    cache.free(0)
    assert cache.free_pages(SLIDING) == 7 and cache.free_pages(FULL) == 7


def test_no_release_keeps_every_page(model):
    ids = tokens(150, seed=23)
    cache = new_cache(num_pages=8, release_window=False)
    cache.add(0)
    run(model, cache, [0], [ids[:149]])
    run(model, cache, [0], [ids[149:]])
    assert -1 not in cache.pages(0, SLIDING) and cache.used_pages(SLIDING) == 3


def test_reused_released_pages_do_not_disturb_the_owner(model):
    a, b = tokens(180, seed=31), tokens(100, seed=32)
    full_a = model(a)
    cache = new_cache(num_pages=8, num_sliding_pages=4)  # sliding pool: pages 1..3
    cache.add("a")
    run(model, cache, ["a"], [a[:100]])  # sliding pages for positions 0..127
    first_pages = cache.pages("a", SLIDING)
    assert cache.free_pages(SLIDING) == 1
    out = run(model, cache, ["a"], [a[100:101]])  # next query at 100 sees 85..100: page 0 released
    assert_logits_close(out[0], full_a[100])
    assert cache.pages("a", SLIDING)[0] == -1
    released = first_pages[0]
    assert cache.free_pages(SLIDING) == 2
    # b takes both free pages, including the one a gave back, and writes its own K/V there
    cache.add("b")
    run(model, cache, ["b"], [b])  # 2 sliding pages
    assert released in cache.pages("b", SLIDING)
    assert cache.free_pages(SLIDING) == 0
    # then garbage, NaN included, in every sliding layer of every page b holds
    for p in cache.pages("b", SLIDING):
        cache.storage[SLIDING][:, p] = float("nan")
    for t in range(101, 128):
        out = run(model, cache, ["a"], [a[t:t + 1]])
        assert_logits_close(out[0], full_a[t])
    # b leaves; its pages, full of a previous owner's (finite) data, are handed to a as it grows:
    # the stale slots past a's length must not matter
    b_pages = cache.pages("b", SLIDING)
    for p in b_pages:
        cache.storage[SLIDING][:, p] = torch.randn(cache.storage[SLIDING][:, p].shape) * 1e4
    cache.free("b")
    for t in range(128, 180):
        out = run(model, cache, ["a"], [a[t:t + 1]])
        assert_logits_close(out[0], full_a[t])
    assert cache.pages("a", SLIDING)[2] in b_pages  # a really runs on a page b left garbage in


def test_stale_nan_in_a_fresh_page_does_not_poison_attention(model):
    """Unwritten slots of a reused page, and the scratch page 0, may hold anything, NaN included."""
    ids = tokens(10, seed=33)
    cache = new_cache(num_pages=4)
    cache.storage[FULL][:] = float("nan")  # a previous owner (or padded tokens) left NaN everywhere
    cache.storage[SLIDING][:] = float("nan")
    cache.add(0)
    out = run(model, cache, [0], [ids])
    assert_logits_close(out[0], model(ids)[-1])


# ------------------------------------------------------------------ bookkeeping

def test_page_layout():
    cache = PagedKVCache(TINY, 5, num_sliding_pages=7, dtype=torch.bfloat16)
    for i in range(TINY.num_hidden_layers):
        pages = 5 if TINY.layer_types[i] == FULL else 7
        assert cache.layer(i).shape == (pages, 2, 64, TINY.num_key_value_heads, TINY.head_dim)
        assert cache.layer(i).dtype == torch.bfloat16
    assert cache.storage[FULL].shape == (2, 5, 2, 64, 2, 16)
    assert cache.storage[SLIDING].shape == (5, 7, 2, 64, 2, 16)
    # layers are distinct views of the group storage
    cache.layer(5).fill_(1)
    assert (cache.layer(6) == 0).all() and (cache.storage[FULL][0] == 1).all()


def test_kv_written_to_index_0_and_1(model):
    """Layer 0 (sliding): K (normed, RoPE'd) at [page, 0, offset], V at [page, 1, offset]."""
    ids = tokens(70, seed=41)
    cache = new_cache()
    cache.add(0)
    run(model, cache, [0], [ids])
    layer = model.model.layers[0]
    c = TINY
    with torch.no_grad():
        x = rms_norm(model.embed(ids), layer.input_layernorm.weight, c.rms_norm_eps)
        k = (x @ layer.self_attn.k_proj.weight.t()).view(70, c.num_key_value_heads, c.head_dim)
        v = (x @ layer.self_attn.v_proj.weight.t()).view(70, c.num_key_value_heads, c.head_dim)
        cos, sin = rope_cos_sin(torch.arange(70), c.head_dim, c.rope_theta)
        k = apply_rope(rms_norm(k, layer.self_attn.k_norm.weight, c.rms_norm_eps), cos, sin)
    pages = cache.pages(0, SLIDING)
    stored_k = torch.cat([cache.layer(0)[p, 0] for p in pages])[:70]
    stored_v = torch.cat([cache.layer(0)[p, 1] for p in pages])[:70]
    torch.testing.assert_close(stored_v, v, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stored_k, k, rtol=1e-5, atol=1e-5)


def test_step_metadata():
    cache = new_cache()
    cache.add("x")
    cache.add("y")
    cache.prepare_step(["x"], [62])
    step = cache.prepare_step(["y", "x"], [3, 4])
    assert step.num_tokens == 7
    assert step.positions.tolist() == [0, 1, 2, 62, 63, 64, 65]
    assert step.last_token_index.tolist() == [2, 6]
    for g in (FULL, SLIDING):
        m = step.groups[g]
        assert m.positions.dtype == torch.int64 and m.slot_mapping.dtype == torch.int64
        assert m.seq_lens.dtype == m.query_start.dtype == m.page_table.dtype == torch.int32
        assert m.seq_lens.tolist() == m.seq_lens_host == [3, 66]
        assert m.query_start.tolist() == m.query_start_host == [0, 3, 7]
        assert not m.decode and m.page_size == 64
        py, px = cache.pages("y", g), cache.pages("x", g)
        assert m.page_table.tolist() == [py + [-1], px]
        expected = [py[0] * 64 + i for i in range(3)] + [px[0] * 64 + 62, px[0] * 64 + 63, px[1] * 64, px[1] * 64 + 1]
        assert m.slot_mapping.tolist() == expected
    step = cache.prepare_step(["x", "y"], [1, 1], max_pages=5)
    assert step.groups[FULL].decode and step.groups[FULL].page_table.shape == (2, 5)
    before = _snapshot(cache, "xy")
    with pytest.raises(ValueError, match="max_pages"):
        cache.prepare_step(["x"], [1], max_pages=1)
    assert _snapshot(cache, "xy") == before  # a refused step changes nothing
    with pytest.raises(ValueError, match="max_pages"):
        cache.prepare_step(["y"], [200], max_pages=2)  # y would need 4 pages
    assert _snapshot(cache, "xy") == before


def test_prepare_step_rejects_bad_requests():
    cache = new_cache()
    cache.add(1)
    with pytest.raises(KeyError):
        cache.add(1)
    with pytest.raises(ValueError):
        cache.prepare_step([1, 1], [1, 1])
    with pytest.raises(ValueError):
        cache.prepare_step([1], [0])
    with pytest.raises(ValueError):
        cache.prepare_step([], [])
    with pytest.raises(ValueError):
        cache.prepare_step([1], [1, 2])
    assert cache.length(1) == 0 and cache.used_pages(FULL) == 0


def _snapshot(cache, seqs):
    return ({g: cache.free_pages(g) for g in (FULL, SLIDING)},
            {s: (cache.length(s), cache.pages(s, FULL), cache.pages(s, SLIDING)) for s in seqs})


def test_cache_full_is_atomic():
    cache = new_cache(num_pages=4)  # 3 usable pages per group
    for s in "abc":
        cache.add(s)
    cache.prepare_step(["a"], [64])
    before = _snapshot(cache, "abc")
    # b fits (1 page), c does not (2 more): nothing at all may be taken
    with pytest.raises(CacheFull, match="full_attention.*needs 3 pages, 2 free"):
        cache.prepare_step(["b", "c"], [10, 65])
    assert _snapshot(cache, "abc") == before
    # the same step fits once a frees its page
    cache.free("a")
    cache.prepare_step(["b", "c"], [10, 65])
    assert cache.free_pages(FULL) == 0


def test_cache_full_in_one_group_takes_nothing_from_the_other():
    cache = new_cache(num_pages=10, num_sliding_pages=2)  # sliding pool has a single page
    cache.add("a")
    cache.add("b")
    cache.prepare_step(["a"], [20])
    before = _snapshot(cache, "ab")
    with pytest.raises(CacheFull, match="sliding_attention"):
        cache.prepare_step(["a", "b"], [1, 1])  # b needs a sliding page, none left
    assert _snapshot(cache, "ab") == before


def test_free_returns_all_pages(model):
    cache = new_cache(num_pages=12, num_sliding_pages=9)
    for i, n in enumerate([150, 64, 1, 65]):
        cache.add(i)
        run(model, cache, [i], [tokens(n, seed=50 + i)])
    run(model, cache, [0, 1, 2, 3], [tokens(1, seed=60 + i) for i in range(4)])  # releases some of 0's pages
    assert cache.used_pages(FULL) == 3 + 2 + 1 + 2
    for i in range(4):
        cache.free(i)
    assert cache.free_pages(FULL) == 11 and cache.used_pages(FULL) == 0
    assert cache.free_pages(SLIDING) == 8 and cache.used_pages(SLIDING) == 0
    for g in (FULL, SLIDING):
        assert sorted(cache._free[g]) == list(range(1, cache.num_pages[g]))  # each page exactly once
    with pytest.raises(KeyError):
        cache.free(0)


def test_page_zero_is_never_handed_out():
    cache = new_cache(num_pages=6, num_sliding_pages=6)
    handed = {FULL: [], SLIDING: []}
    for i in range(5):
        cache.add(i)
        cache.prepare_step([i], [64])
        for g in handed:
            handed[g] += cache.pages(i, g)
    for g in handed:
        assert sorted(handed[g]) == [1, 2, 3, 4, 5]
    cache.add(5)
    with pytest.raises(CacheFull):
        cache.prepare_step([5], [1])
    # freed pages come back, and still never page 0
    cache.free(2)
    cache.prepare_step([5], [1])
    assert cache.pages(5, FULL) == [3] and cache.pages(5, SLIDING) == [3]
    with pytest.raises(ValueError, match="page 0 is reserved"):
        PagedKVCache(TINY, 1)


def test_for_sequences_sizes_the_pool(model):
    cache = PagedKVCache.for_sequences(TINY, [64, 65, 1], dtype=torch.float32)
    assert cache.num_pages[FULL] == 1 + 1 + 2 + 1
    for i, n in enumerate([64, 65, 1]):
        cache.add(i)
    cache.prepare_step([0, 1, 2], [64, 65, 1])
    assert cache.free_pages(FULL) == 0


def test_a_model_without_full_layers_steps_through_the_cache():
    """Every layer sliding (a config the checker allows): the empty full group still hands out pages,
    holding no bytes, and decode after a prefill equals the one-shot prefill."""
    import dataclasses

    cfg = dataclasses.replace(TINY, layer_types=[SLIDING] * TINY.num_hidden_layers)
    sliding = BeamForCausalLM.random(cfg, dtype=torch.float32)
    ids = tokens(W + 5, seed=3)
    cache = PagedKVCache.for_sequences(cfg, [len(ids)], dtype=torch.float32)
    assert cache.storage[FULL].numel() == 0
    cache.add(0)
    run(sliding, cache, [0], [ids[:-1]])
    assert_logits_close(run(sliding, cache, [0], [ids[-1:]]), sliding(ids[None])[:, -1])
