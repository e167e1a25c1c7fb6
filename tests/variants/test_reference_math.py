"""Beam's reference math against hand-worked examples and closed forms.

Covers the torch reference variants (through `workbench.registry.reference`) and the helpers in
`beam_model.functional`: routing, SSMax, depth-scaled residual, window masks, the experts
strategies, RoPE, soft-cap and sampling.
"""

import math

import pytest
import torch

from beam_model.config import FULL, SLIDING, BeamConfig
from beam_model.functional import (
    apply_rope,
    residual_coefficients,
    rms_norm,
    rope_cos_sin,
    soft_cap,
    ssmax_scale,
    swiglu,
)
from beam_model.kv_cache import PagedKVCache
from workbench.registry import reference
from workbench.variants import experts as experts_mod

SCALE = 2.5


# ====================================================================== (a) routing

def _logit(p):
    return math.log(p / (1 - p))


def route(scores, bias=None, *, n_group, topk_group, top_k, scale=SCALE):
    """Route rows whose sigmoid scores are given exactly: x = logit(s), router weight = identity."""
    s = torch.tensor(scores, dtype=torch.float64)
    if s.dim() == 1:
        s = s[None]
    x = torch.log(s / (1 - s)).float()
    e = s.shape[-1]
    w = {"weight": torch.eye(e, dtype=torch.float32),
         "bias": torch.zeros(e) if bias is None else torch.tensor(bias, dtype=torch.float32)}
    ids, weights = reference("route").fn(x, w, n_group=n_group, topk_group=topk_group, top_k=top_k, scale=scale)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == (s.shape[0], top_k)
    return ids, weights


def as_dict(ids, weights, row=0):
    """{expert: weight} of one row (the contract leaves the order free)."""
    return {int(i): float(w) for i, w in zip(ids[row], weights[row])}


def assert_routed(got, expected):
    assert set(got) == set(expected)
    for e, w in expected.items():
        assert got[e] == pytest.approx(w, rel=1e-5), e


# 8 experts, 4 groups of 2. Group scores (sum of the top 2 = both): g0 .9+.1=1.0, g1 .8+.7=1.5,
# g2 .6+.5=1.1, g3 .95+.05=1.0 -> keep g1, g2 -> experts 2..5 -> top-2: 2 (.8), 3 (.7).
# Expert 6 (.95) has the best score of all but sits in a dropped group.
S8 = [0.9, 0.1, 0.8, 0.7, 0.6, 0.5, 0.95, 0.05]
KW8 = dict(n_group=4, topk_group=2, top_k=2)


def test_route_hand_worked():
    got = as_dict(*route(S8, **KW8))
    assert_routed(got, {2: 0.8 / 1.5 * SCALE, 3: 0.7 / 1.5 * SCALE})


def test_route_group_masking_drops_best_expert():
    got = as_dict(*route(S8, **KW8))
    assert 6 not in got  # highest score (.95) but group 3 scores only 1.0
    assert 0 not in got  # .9 beats every kept expert, but group 0 scores only 1.0
    # Without group limiting (all 4 groups kept) the two best experts win.
    got = as_dict(*route(S8, n_group=4, topk_group=4, top_k=2))
    assert_routed(got, {6: 0.95 / 1.85 * SCALE, 0: 0.9 / 1.85 * SCALE})


def test_route_bias_changes_selection_not_weights():
    # +0.35 on expert 5: biased .85 -> group 2 scores 1.45 (still kept), expert 5 now beats 2 (.8)
    # and 3 (.7) in selection; weights use the *unbiased* .5 and .8.
    bias = [0, 0, 0, 0, 0, 0.35, 0, 0]
    got = as_dict(*route(S8, bias, **KW8))
    assert_routed(got, {5: 0.5 / 1.3 * SCALE, 2: 0.8 / 1.3 * SCALE})


def test_route_bias_changes_group_selection():
    # +0.6 on expert 0: group 0 scores 1.5+0.1=1.6 and is kept with group 1 (1.5); the selection
    # among experts 0..3 is 0 (biased 1.5) and 2 (.8); weights unbiased .9 and .8.
    bias = [0.6, 0, 0, 0, 0, 0, 0, 0]
    got = as_dict(*route(S8, bias, **KW8))
    assert_routed(got, {0: 0.9 / 1.7 * SCALE, 2: 0.8 / 1.7 * SCALE})


def test_route_negative_bias_deselects():
    # -0.3 on expert 2: biased .5; group 1 scores 1.2, group 2 1.1, groups 0 and 3 1.0:
    # keep g1, g2; selection among 2 (.5), 3 (.7), 4 (.6), 5 (.5) -> 3, 4.
    bias = [0, 0, -0.3, 0, 0, 0, 0, 0]
    got = as_dict(*route(S8, bias, **KW8))
    assert_routed(got, {3: 0.7 / 1.3 * SCALE, 4: 0.6 / 1.3 * SCALE})


def test_route_group_score_is_top2_sum():
    # 2 groups of 4, keep 1. Group A [.9 .2 .2 .2]: top-2 sum 1.1, full sum 1.5, max .9.
    # Group B [.65 .55 .1 .1]: top-2 sum 1.2, full sum 1.4, max .65. Only the top-2 sum keeps B.
    s = [0.9, 0.2, 0.2, 0.2, 0.65, 0.55, 0.1, 0.1]
    got = as_dict(*route(s, n_group=2, topk_group=1, top_k=2))
    assert_routed(got, {4: 0.65 / 1.2 * SCALE, 5: 0.55 / 1.2 * SCALE})


def test_route_rows_are_independent():
    rows = [S8, list(reversed(S8))]
    ids, weights = route(rows, **KW8)
    assert_routed(as_dict(ids, weights, 0), {2: 0.8 / 1.5 * SCALE, 3: 0.7 / 1.5 * SCALE})
    # reversed: experts 7-e; groups g0 (.05,.95)=1.0, g1 (.5,.6)=1.1, g2 (.7,.8)=1.5, g3 (.1,.9)=1.0
    assert_routed(as_dict(ids, weights, 1), {5: 0.8 / 1.5 * SCALE, 4: 0.7 / 1.5 * SCALE})


def test_route_scale_and_top_k():
    got = as_dict(*route(S8, n_group=4, topk_group=2, top_k=3, scale=1.0))
    assert_routed(got, {2: 0.8 / 2.1, 3: 0.7 / 2.1, 4: 0.6 / 2.1})


@pytest.mark.parametrize("preset", ["beam-tiny", "beam-501b"])
def test_route_random_invariants(preset):
    c = BeamConfig.from_preset(preset)
    g = torch.Generator().manual_seed(0)
    hidden = 64
    x = torch.randn(64, hidden, generator=g)
    w = {"weight": torch.randn(c.n_routed_experts, hidden, generator=g) * 0.3,
         "bias": torch.randn(c.n_routed_experts, generator=g) * 0.05}
    ids, weights = reference("route").fn(x, w, n_group=c.n_group, topk_group=c.topk_group,
                                         top_k=c.num_experts_per_tok, scale=c.routed_scaling_factor)
    assert ids.shape == (64, c.num_experts_per_tok)
    torch.testing.assert_close(weights.sum(-1), torch.full((64,), c.routed_scaling_factor), rtol=1e-6, atol=1e-6)
    assert (weights > 0).all()
    per_group = c.n_routed_experts // c.n_group
    scores = torch.sigmoid(x @ w["weight"].t())
    biased = scores + w["bias"]
    for n in range(64):
        row = ids[n].tolist()
        assert len(set(row)) == len(row)
        assert len({e // per_group for e in row}) <= c.topk_group
        # weights are the unbiased scores, renormalised
        expected = scores[n, ids[n]] / scores[n, ids[n]].sum() * c.routed_scaling_factor
        torch.testing.assert_close(weights[n], expected, rtol=1e-5, atol=1e-6)
        # independent recomputation of the selection (sets)
        gs = biased[n].view(c.n_group, per_group).topk(2).values.sum(-1)
        kept = set(gs.topk(c.topk_group).indices.tolist())
        masked = biased[n].clone()
        for e in range(c.n_routed_experts):
            if e // per_group not in kept:
                masked[e] = -math.inf
        assert set(row) == set(masked.topk(c.num_experts_per_tok).indices.tolist())


# ====================================================================== (b) SSMax

@pytest.mark.parametrize("position, p", [(0, 1), (1, 2), (2047, 2048), (2048, 2049), (1048575, 1048576)])
def test_ssmax_closed_form(position, p):
    got = ssmax_scale(torch.tensor([position]), 2048.0, 0.1)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx((1 + p / 2048) ** 0.1, rel=1e-6)


def test_ssmax_named_values():
    f = ssmax_scale(torch.tensor([0, 2047, 6143]), 2048.0, 0.1)
    assert f[0].item() == pytest.approx((2049 / 2048) ** 0.1, rel=1e-7)
    assert f[1].item() == pytest.approx(2 ** 0.1, rel=1e-6)  # p = 2048
    assert f[2].item() == pytest.approx(4 ** 0.1, rel=1e-6)  # p = 6144
    assert (f[1:] > f[:-1]).all()


def _qk_prep_call(rope_theta, ssmax, positions, seed=0):
    hd, heads, kvh = 16, 4, 2
    g = torch.Generator().manual_seed(seed)
    n = len(positions)
    q = torch.randn(n, heads * hd, generator=g)
    k = torch.randn(n, kvh * hd, generator=g)
    v = torch.randn(n, kvh * hd, generator=g)
    w = {"q_norm": 1 + 0.1 * torch.randn(hd, generator=g), "k_norm": 1 + 0.1 * torch.randn(hd, generator=g)}
    cache = torch.zeros(4, 2, 64, kvh, hd)
    pos = torch.tensor(positions)
    slots = 64 + torch.arange(n)  # page 1
    out = reference("qk_prep").fn(q, k, v, w, cache=cache, slot_mapping=slots, positions=pos, eps=1e-6,
                                  rope_theta=rope_theta, ssmax=ssmax)
    qn = rms_norm(q.view(n, heads, hd), w["q_norm"], 1e-6)
    kn = rms_norm(k.view(n, kvh, hd), w["k_norm"], 1e-6)
    return out, qn, kn, v.view(n, kvh, hd), cache


def test_qk_prep_full_layer_applies_ssmax_to_q_only():
    positions = [0, 5, 2047, 100000]
    out, qn, kn, v, cache = _qk_prep_call(None, (2048.0, 0.1), positions)
    factor = torch.tensor([(1 + (p + 1) / 2048) ** 0.1 for p in positions])
    torch.testing.assert_close(out, qn * factor[:, None, None], rtol=1e-6, atol=1e-6)
    # K and V go to the cache untouched by position (NoPE, no SSMax): K at index 0, V at index 1.
    torch.testing.assert_close(cache[1, 0, :4], kn, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache[1, 1, :4], v)
    assert (cache[0] == 0).all() and (cache[2:] == 0).all() and (cache[1, :, 4:] == 0).all()


def test_qk_prep_sliding_layer_applies_rope_to_q_and_k():
    positions = [0, 1, 17, 600]
    out, qn, kn, v, cache = _qk_prep_call(10000.0, None, positions)
    cos, sin = rope_cos_sin(torch.tensor(positions), 16, 10000.0)
    torch.testing.assert_close(out, apply_rope(qn, cos, sin), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache[1, 0, :4], apply_rope(kn, cos, sin), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache[1, 1, :4], v)
    torch.testing.assert_close(out[0], qn[0], rtol=1e-6, atol=1e-6)  # position 0: no rotation


# ====================================================================== (c) depth-scaled residual

def test_residual_coefficients():
    for k in range(1, 105):
        a, b = residual_coefficients(k)
        assert a * a + b * b == pytest.approx(1.0, abs=1e-12)
        assert a == pytest.approx(math.sqrt(k / (k + 1)))
        assert b == pytest.approx(1 / math.sqrt(k + 1))
    assert residual_coefficients(1) == pytest.approx((math.sqrt(0.5), math.sqrt(0.5)))
    for bad in (0, -1):
        with pytest.raises(ValueError):
            residual_coefficients(bad)


def test_residual_is_scaled_sum_of_all_terms():
    # h after add k == (embedding + y_1 + ... + y_k) / sqrt(k+1): every term weighs the same.
    g = torch.Generator().manual_seed(0)
    terms = torch.randn(105, 1000, generator=g, dtype=torch.float64)
    h = terms[0].clone()
    for k in range(1, 105):
        a, b = residual_coefficients(k)
        h = a * h + b * terms[k]
        torch.testing.assert_close(h, terms[: k + 1].sum(0) / math.sqrt(k + 1))


def test_residual_variance_stays_one():
    g = torch.Generator().manual_seed(1)
    n = 200_000
    h = torch.randn(n, generator=g, dtype=torch.float64)
    for k in range(1, 105):
        a, b = residual_coefficients(k)
        h = a * h + b * torch.randn(n, generator=g, dtype=torch.float64)
        if k in (1, 10, 52, 104):
            assert h.var().item() == pytest.approx(1.0, abs=0.02), k  # std of the estimate ~0.003


def _bw(post, nxt, k):
    """Boundary weights of the k-th residual add (the model's layout: coefficients in `w`)."""
    return {"post_norm": post, "next_norm": nxt,
            "residual": torch.tensor(residual_coefficients(k), dtype=torch.float32)}


def test_boundary_reference_keeps_unit_variance():
    bnd = reference("boundary").fn
    g = torch.Generator().manual_seed(2)
    n, hidden = 256, 64
    ones = torch.ones(hidden)
    h = torch.randn(n, hidden, generator=g)
    for k in range(1, 105):
        # sub-layer outputs of arbitrary scale: the post-norm brings them to unit RMS
        y = torch.randn(n, hidden, generator=g) * (0.01 if k % 2 else 50.0)
        h_in = h
        h, x = bnd(y, h, _bw(ones, ones, k), eps=1e-6)
        if k in (1, 2, 52, 103, 104):
            a, b = residual_coefficients(k)
            torch.testing.assert_close(h, a * h_in + b * rms_norm(y, ones, 1e-6), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(x, rms_norm(h, ones, 1e-6))
            assert x.pow(2).mean(-1).sqrt().sub(1).abs().max() < 1e-4  # next pre-norm: unit RMS per row
            assert h.var().item() == pytest.approx(1.0, abs=0.03), k
    # After the last sub-layer there is no next norm.
    h2, x2 = bnd(y, h, _bw(ones, None, 104), eps=1e-6)
    assert x2 is None and h2.shape == h.shape


def test_boundary_does_not_modify_inputs():
    g = torch.Generator().manual_seed(3)
    y, h = torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)
    y0, h0 = y.clone(), h.clone()
    reference("boundary").fn(y, h, _bw(torch.ones(64), torch.ones(64), 3), eps=1e-6)
    assert torch.equal(y, y0) and torch.equal(h, h0)


def test_model_boundaries_use_the_kth_coefficients():
    """Sub-layer i (attention 2i+1, MLP 2i+2, counted from 1) gets residual_coefficients(k)."""
    from beam_model.model import BeamForCausalLM

    model = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32)
    n = model.config.num_hidden_layers
    for i, layer in enumerate(model.model.layers):
        for site, k in (("boundary_attn", 2 * i + 1), ("boundary_mlp", 2 * i + 2)):
            w = layer.prepared[site]
            torch.testing.assert_close(w["residual"], torch.tensor(residual_coefficients(k)))
            assert (w["next_norm"] is None) == (k == 2 * n)
    assert 2 * n == model.config.num_residual_adds


# ====================================================================== (d) window mask

TINY = BeamConfig.from_preset("beam-tiny")
W = TINY.sliding_window  # 16
SLIDING_LAYER, FULL_LAYER = TINY.sliding_layers[0], TINY.full_attention_layers[0]


def _slot(cache, seq, group, pos):
    return cache.pages(seq, group)[pos // 64] * 64 + pos % 64


def _marker_cache(lengths, new_tokens):
    """A float32 tiny cache with sequences prefilled to `lengths` (bookkeeping only, K = V = 0)
    and a step of `new_tokens` per sequence prepared. Returns (cache, step metadata)."""
    cache = PagedKVCache(TINY, 32, dtype=torch.float32)
    for s, n in enumerate(lengths):
        cache.add(s)
        if n:
            cache.prepare_step([s], [n])
    return cache, cache.prepare_step(list(range(len(lengths))), new_tokens)


def _attn(q, cache, meta, layer, window):
    return reference("attention").fn(q, cache.layer(layer), meta, window=window, scale=TINY.head_dim ** -0.5)


@pytest.mark.parametrize("group, window", [(SLIDING, W), (FULL, None)])
def test_prefill_visibility_matrix(group, window):
    """With K = 0 every visible key scores the same, so out[t] = mean of the visible V's.
    A marker V at position j shows at query t iff j is visible from t, with weight 1/#visible."""
    t_len = 80  # crosses the window and a page boundary
    layer = SLIDING_LAYER if group == SLIDING else FULL_LAYER
    cache, step = _marker_cache([0], [t_len])
    meta = step.groups[group]
    assert not meta.decode
    q = torch.randn(t_len, TINY.num_attention_heads, TINY.head_dim, generator=torch.Generator().manual_seed(0))
    kv = cache.layer(layer)
    seen = torch.zeros(t_len, t_len, dtype=torch.bool)
    for j in range(t_len):
        kv.zero_()
        kv[_slot(cache, 0, group, j) // 64, 1, j % 64] = 1.0
        out = _attn(q, cache, meta, layer, window)
        seen[:, j] = out[:, 0, 0] > 0
        count = torch.tensor([min(t + 1, window or t + 1) for t in range(t_len)], dtype=torch.float32)
        vis = out[:, 0, 0] > 0
        torch.testing.assert_close(out[vis, 0, 0], 1 / count[vis])
    t = torch.arange(t_len)[:, None]
    j = torch.arange(t_len)[None, :]
    expected = j <= t
    if window is not None:
        expected &= j >= t - window + 1
    assert torch.equal(seen, expected)
    # The edges spelled out for one query.
    t0 = 70
    if window is not None:
        assert seen[t0, t0 - W + 1] and not seen[t0, t0 - W] and seen[t0, t0] and not seen[t0, t0 + 1]
    else:
        assert seen[t0, 0] and seen[t0, t0] and not seen[t0, t0 + 1]


@pytest.mark.parametrize("group, window", [(SLIDING, W), (FULL, None)])
def test_decode_window_edges(group, window):
    """Batched decode (the vectorised path): per sequence, channel 0 marks t-W+1, channel 1 t-W,
    channel 2 t+1 (stale data in an allocated slot past the end), channel 3 position 0."""
    lengths = [20, 70, 130, 16]  # the new token sits at position t = length
    layer = SLIDING_LAYER if group == SLIDING else FULL_LAYER
    cache, step = _marker_cache(lengths, [1] * len(lengths))
    meta = step.groups[group]
    assert meta.decode
    kv = cache.layer(layer)
    kv.zero_()
    for s, t in enumerate(lengths):
        for ch, pos in enumerate([t - W + 1, t - W, t + 1, 0]):
            slot = _slot(cache, s, group, pos)
            kv[slot // 64, 1, slot % 64, :, ch] += 1.0
    q = torch.randn(len(lengths), TINY.num_attention_heads, TINY.head_dim, generator=torch.Generator().manual_seed(0))
    out = _attn(q, cache, meta, layer, window)
    for s, t in enumerate(lengths):
        o = out[s, :, :4]
        if window is not None:
            n = W
            expected = [1 / n, 0.0, 0.0, (1 / n) if t - W + 1 <= 0 else 0.0]
        else:
            n = t + 1
            expected = [1 / n, 1 / n, 0.0, 1 / n]
        torch.testing.assert_close(o, torch.tensor(expected).expand(TINY.num_attention_heads, 4))


def test_prefill_sequences_do_not_see_each_other():
    cache, step = _marker_cache([0, 0], [40, 30])
    meta = step.groups[SLIDING]
    kv = cache.layer(SLIDING_LAYER)
    kv.zero_()
    slot = _slot(cache, 0, SLIDING, 10)
    kv[slot // 64, 1, slot % 64] = 1.0  # sequence 0, position 10
    q = torch.zeros(70, TINY.num_attention_heads, TINY.head_dim)
    out = _attn(q, cache, meta, SLIDING_LAYER, W)
    assert (out[10:26, :, 0] > 0).all() and (out[:10, :, 0] == 0).all() and (out[26:40, :, 0] == 0).all()
    assert (out[40:, :, 0] == 0).all()  # sequence 1 (positions 0..29) never sees sequence 0's key


def test_gqa_head_mapping():
    """Query head h reads kv head h // (heads / kv_heads)."""
    cache, step = _marker_cache([5], [1])
    meta = step.groups[FULL]
    kv = cache.layer(FULL_LAYER)
    kv.zero_()
    for pos in range(6):
        slot = _slot(cache, 0, FULL, pos)
        kv[slot // 64, 1, slot % 64, 1, :] = 1.0  # kv head 1 only
    q = torch.randn(1, TINY.num_attention_heads, TINY.head_dim)
    out = _attn(q, cache, meta, FULL_LAYER, None)
    group = TINY.num_attention_heads // TINY.num_key_value_heads
    for h in range(TINY.num_attention_heads):
        expected = 1.0 if h // group == 1 else 0.0
        torch.testing.assert_close(out[0, h], torch.full((TINY.head_dim,), expected))


def test_attention_scores_and_softmax():
    """A non-degenerate check of the reference against explicit softmax(q k^T * scale) v."""
    cache, step = _marker_cache([37], [1])
    meta = step.groups[FULL]
    kv = cache.layer(FULL_LAYER)
    g = torch.Generator().manual_seed(5)
    keys = torch.randn(38, TINY.num_key_value_heads, TINY.head_dim, generator=g)
    vals = torch.randn(38, TINY.num_key_value_heads, TINY.head_dim, generator=g)
    for pos in range(38):
        slot = _slot(cache, 0, FULL, pos)
        kv[slot // 64, 0, slot % 64] = keys[pos]
        kv[slot // 64, 1, slot % 64] = vals[pos]
    q = torch.randn(1, TINY.num_attention_heads, TINY.head_dim, generator=g)
    scale = TINY.head_dim ** -0.5
    out = _attn(q, cache, meta, FULL_LAYER, None)
    group = TINY.num_attention_heads // TINY.num_key_value_heads
    for h in range(TINY.num_attention_heads):
        p = torch.softmax(keys[:, h // group] @ q[0, h] * scale, 0)
        torch.testing.assert_close(out[0, h], p @ vals[:, h // group], rtol=1e-5, atol=1e-6)


# ====================================================================== (e) experts strategies

def _expert_inputs(n, e=16, hidden=64, ff=32, top_k=4, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g).to(dtype)
    w = {"gate_proj": (torch.randn(e, ff, hidden, generator=g) / 8).to(dtype),
         "up_proj": (torch.randn(e, ff, hidden, generator=g) / 8).to(dtype),
         "down_proj": (torch.randn(e, hidden, ff, generator=g) / 6).to(dtype)}
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(n)])
    weights = torch.rand(n, top_k, generator=g) + 0.1
    weights = weights / weights.sum(-1, keepdim=True) * 2.5
    return x, ids, weights, w


def _naive_experts(x, ids, weights, w):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for n in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[n, k]
            y = swiglu(x[n:n + 1].double(), w["gate_proj"][e].double(), w["up_proj"][e].double(),
                       w["down_proj"][e].double())
            out[n] += weights[n, k].double() * y[0]
    return out


@pytest.mark.parametrize("n", [1, 3, 4, 37, 300])
def test_expert_strategies_agree(n):
    x, ids, weights, w = _expert_inputs(n)
    naive = _naive_experts(x, ids, weights, w).float()
    results = {name: getattr(experts_mod, name)(x, ids, weights, w) for name in ("_gathered", "_dense", "_grouped")}
    for name, y in results.items():
        assert y.shape == x.shape and y.dtype == torch.float32, name
        torch.testing.assert_close(y, naive, rtol=1e-5, atol=1e-5, msg=name)
    torch.testing.assert_close(results["_gathered"], results["_dense"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results["_dense"], results["_grouped"], rtol=1e-5, atol=1e-5)
    out = reference("experts").fn(x, ids, weights, w)
    torch.testing.assert_close(out, naive, rtol=1e-5, atol=1e-5)


def test_expert_strategies_agree_bf16():
    x, ids, weights, w = _expert_inputs(40, dtype=torch.bfloat16, seed=1)
    ys = [getattr(experts_mod, name)(x, ids, weights, w) for name in ("_gathered", "_dense", "_grouped")]
    ref = _naive_experts(x, ids, weights, w).float()
    for y in ys:
        # each rounds the activation to bf16 once: agree to bf16 precision
        torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2)
    assert reference("experts").fn(x, ids, weights, w).dtype == torch.bfloat16


def test_expert_strategy_dispatch(monkeypatch):
    """The reference picks by token count: gathered when n*top_k <= experts, dense up to 256 tokens,
    grouped beyond. Each path really is taken (and computes the same function, above)."""
    called = []
    for name in ("_gathered", "_dense", "_grouped"):
        fn = getattr(experts_mod, name)
        monkeypatch.setattr(experts_mod, name, lambda *a, _fn=fn, _name=name: called.append(_name) or _fn(*a))
    for n, expected in [(4, "_gathered"), (5, "_dense"), (256, "_dense"), (257, "_grouped")]:
        x, ids, weights, w = _expert_inputs(n)
        reference("experts").fn(x, ids, weights, w)
        assert called[-1] == expected, n


def test_expert_weights_are_linear():
    """Zero weight for a slot removes that expert's contribution entirely."""
    x, ids, weights, w = _expert_inputs(6)
    weights2 = weights.clone()
    weights2[:, 1:] = 0
    y = experts_mod._dense(x, ids, weights2, w)
    naive = _naive_experts(x, ids[:, :1], weights2[:, :1], w).float()
    torch.testing.assert_close(y, naive, rtol=1e-5, atol=1e-5)


# ====================================================================== (f) RoPE

def _rope_complex(x, positions, theta):
    """Pairs (i, i + D/2) as complex numbers, rotated by angle p * theta^(-2i/D)."""
    d = x.shape[-1]
    half = d // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    inv = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / d)
    rot = torch.polar(torch.ones(len(positions), half, dtype=torch.float64),
                      positions.double()[:, None] * inv[None, :])
    z = z * rot[:, None, :]
    return torch.cat([z.real, z.imag], -1)


def test_rope_position_zero_is_identity():
    x = torch.randn(3, 4, 128)
    cos, sin = rope_cos_sin(torch.zeros(3, dtype=torch.int64), 128, 10000.0)
    assert (cos == 1).all() and (sin == 0).all()
    assert torch.equal(apply_rope(x, cos, sin), x)


@pytest.mark.parametrize("hd", [16, 128])
def test_rope_matches_complex_rotate_half(hd):
    g = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 2, 15, 16, 511, 512, 4095, 1048575])
    x = torch.randn(len(positions), 3, hd, generator=g)
    cos, sin = rope_cos_sin(positions, hd, 10000.0)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (len(positions), hd // 2)
    got = apply_rope(x, cos, sin)
    torch.testing.assert_close(got.double(), _rope_complex(x, positions, 10000.0), rtol=1e-5, atol=1e-5)


def test_rope_is_not_interleaved():
    """Dimension 0 pairs with D/2 (neox), not with dimension 1 (GPT-J interleaved)."""
    hd = 16
    x = torch.zeros(1, 1, hd)
    x[0, 0, 0] = 1.0
    cos, sin = rope_cos_sin(torch.tensor([1]), hd, 10000.0)
    y = apply_rope(x, cos, sin)[0, 0]
    assert y[0].item() == pytest.approx(math.cos(1.0), rel=1e-6)
    assert y[hd // 2].item() == pytest.approx(math.sin(1.0), rel=1e-6)
    assert y[1].item() == 0.0
    # The slowest pair (i = D/2 - 1) turns by theta^(-(D-2)/D) per position.
    assert sin[0, -1].item() == pytest.approx(math.sin(10000.0 ** (-(hd - 2) / hd)), rel=1e-6)


def test_rope_is_relative_and_norm_preserving():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 128, generator=g), torch.randn(1, 1, 128, generator=g)

    def rot(x, p):
        cos, sin = rope_cos_sin(torch.tensor([p]), 128, 10000.0)
        return apply_rope(x, cos, sin)

    dots = [(rot(q, m) * rot(k, m - 7)).sum().item() for m in (7, 100, 5000)]
    assert dots[1] == pytest.approx(dots[0], rel=1e-4, abs=1e-4)
    assert dots[2] == pytest.approx(dots[0], rel=1e-4, abs=1e-4)
    assert rot(q, 12345).norm().item() == pytest.approx(q.norm().item(), rel=1e-5)


# ====================================================================== (g) soft-cap

def test_soft_cap_bounds():
    x = torch.tensor([-1e30, -1e6, -500.0, -100.0, -30.0, 30.0, 100.0, 500.0, 1e6, 1e30])
    y = soft_cap(x, 30.0)
    assert y.dtype == torch.float32
    assert (y.abs() <= 30.0).all()
    # strictly inside the cap for any value short of FP32 tanh saturation
    assert (soft_cap(torch.linspace(-200, 200, 4001), 30.0).abs() < 30.0).all()
    assert torch.equal(torch.sign(y), torch.sign(x))
    assert y[5].item() == pytest.approx(30 * math.tanh(1.0), rel=1e-6)


def test_soft_cap_identity_for_small_values():
    x = torch.linspace(-1.0, 1.0, 201)
    y = soft_cap(x, 30.0)
    # 30 tanh(x/30) = x - x^3/2700 + ...: relative error below 4e-4 for |x| <= 1
    torch.testing.assert_close(y, x, rtol=4e-4, atol=1e-7)
    assert torch.all(torch.diff(soft_cap(torch.linspace(-300, 300, 1001), 30.0)) >= 0)  # monotone


def test_soft_cap_in_half_precision_computes_in_fp32():
    x = torch.tensor([29.0, 100.0], dtype=torch.bfloat16)
    y = soft_cap(x, 30.0)
    assert y.dtype == torch.float32
    assert y[1].item() < 30.0


def test_head_reference_caps_logits():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(8, 64, generator=g)
    w = {"norm": torch.ones(64), "lm_head": torch.randn(288, 64, generator=g) * 20}
    logits = reference("head").fn(h, w, eps=1e-6, softcap=30.0)
    assert logits.dtype == torch.float32 and logits.shape == (8, 288)
    assert (logits.abs() <= 30).all() and logits.abs().max() > 25
    raw = torch.nn.functional.linear(rms_norm(h, w["norm"], 1e-6), w["lm_head"])
    torch.testing.assert_close(logits, 30 * torch.tanh(raw / 30), rtol=1e-5, atol=1e-5)


# ====================================================================== (h) sampling

def _sample(logits, temperature, top_k=0, top_p=1.0, generator=None):
    n = logits.shape[0]
    return reference("sample").fn(
        logits,
        torch.full((n,), float(temperature)),
        torch.full((n,), int(top_k), dtype=torch.int64),
        torch.full((n,), float(top_p)),
        generator=generator,
    )


@pytest.fixture
def rand_logits():
    return torch.randn(64, 50, generator=torch.Generator().manual_seed(0)) * 3


def test_sample_greedy(rand_logits):
    ids = _sample(rand_logits, 0.0, generator=torch.Generator().manual_seed(1))
    assert ids.dtype == torch.int64 and ids.shape == (64,)
    assert torch.equal(ids, rand_logits.argmax(-1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 5.0, 100.0])
def test_sample_top_k_1_is_argmax(rand_logits, temperature):
    ids = _sample(rand_logits, temperature, top_k=1, generator=torch.Generator().manual_seed(2))
    assert torch.equal(ids, rand_logits.argmax(-1))


@pytest.mark.parametrize("temperature", [1.0, 10.0])
def test_sample_tiny_top_p_is_argmax(rand_logits, temperature):
    ids = _sample(rand_logits, temperature, top_p=1e-6, generator=torch.Generator().manual_seed(3))
    assert torch.equal(ids, rand_logits.argmax(-1))


def test_sample_same_seed_same_draws(rand_logits):
    a = _sample(rand_logits, 1.0, generator=torch.Generator().manual_seed(42))
    b = _sample(rand_logits, 1.0, generator=torch.Generator().manual_seed(42))
    c = _sample(rand_logits, 1.0, generator=torch.Generator().manual_seed(43))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert not torch.equal(a, rand_logits.argmax(-1))  # really sampling at T=1


def test_sample_per_row_parameters(rand_logits):
    n = rand_logits.shape[0]
    temperature = torch.where(torch.arange(n) % 2 == 0, 0.0, 1.0)
    ids = reference("sample").fn(rand_logits, temperature, torch.zeros(n, dtype=torch.int64), torch.ones(n),
                                 generator=torch.Generator().manual_seed(4))
    assert torch.equal(ids[::2], rand_logits[::2].argmax(-1))


DRAWS = 40_000
SMALL = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def _frequencies(temperature, top_k=0, top_p=1.0, seed=0):
    logits = SMALL.expand(DRAWS, -1).contiguous()
    ids = _sample(logits, temperature, top_k, top_p, generator=torch.Generator().manual_seed(seed))
    return torch.bincount(ids, minlength=len(SMALL)).float() / DRAWS


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_sample_frequencies_match_softmax(temperature):
    freq = _frequencies(temperature)
    expected = torch.softmax(SMALL / temperature, -1)
    # binomial std <= sqrt(.25/40000) = 0.0025: 0.012 is ~5 sigma
    torch.testing.assert_close(freq, expected, rtol=0, atol=0.012)


def test_sample_frequencies_top_k():
    freq = _frequencies(1.0, top_k=2, seed=1)
    expected = torch.zeros(len(SMALL))
    expected[:2] = torch.softmax(SMALL[:2], -1)
    torch.testing.assert_close(freq, expected, rtol=0, atol=0.012)
    assert (freq[2:] == 0).all()


def test_sample_frequencies_top_p():
    p = torch.softmax(SMALL, -1)  # ~ [.57, .21, .13, .08, .03, .004]
    top_p = float(p[0] + p[1]) - 0.01  # keeps tokens 0, 1 (token 1 starts below top_p)
    freq = _frequencies(1.0, top_p=top_p, seed=2)
    expected = torch.zeros(len(SMALL))
    expected[:2] = p[:2] / p[:2].sum()
    torch.testing.assert_close(freq, expected, rtol=0, atol=0.012)
    assert (freq[2:] == 0).all()
