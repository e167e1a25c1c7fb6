"""Triton variants of `route`, `head` and `sample` against their torch references.

CPU: the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU) at tiny shapes.
GPU (`-m gpu`): route:triton's regimes at beam-501b-tp8 shapes. (The op gate, every config, CPU and
GPU shapes: test_every_variant.py.)
"""

import math

import pytest
import torch

from workbench.registry import get, reference

triton = pytest.importorskip("triton")

from workbench.variants.head import triton as head_triton  # noqa: E402
from workbench.variants.head import triton_softcap as head_softcap  # noqa: E402
from workbench.variants.kernels import route_select  # noqa: E402
from workbench.variants.route import triton as route_triton  # noqa: E402
from workbench.variants.sample import contract_probs  # noqa: E402

# (experts, groups, kept groups, top_k, hidden): beam-tiny's router, and the real 256 / 8 layout.
# "long": hidden 3000 is a multiple of no block size: masked K tails, several K steps and split-K.
ROUTE_SHAPES = {"tiny": (16, 4, 2, 4, 64), "e256": (256, 8, 4, 8, 32), "long": (16, 4, 2, 4, 3000)}
ROUTE_N = (1, 2, 5, 20, 100)  # GEMV (1, 2, 5), FP32 tiles (20), BF16x3 tensor cores (100)
# The first config, and the configs with the keyed selection (`route_select.select_experts`): the edge
# cases below run on both selection forms.
SELECTIONS = [0] + [i for i, c in enumerate(route_triton.CONFIGS) if c.get("select_keys")]


# ====================================================================== route

def _route_case(shape, n, dtype=torch.bfloat16, seed=0):
    e, g, tg, tk, hidden = ROUTE_SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    w = {"weight": torch.randn(e, hidden, generator=gen) / math.sqrt(hidden),
         "bias": torch.randn(e, generator=gen) * 0.05}
    x = torch.randn(n, hidden, generator=gen).to(dtype)
    return x, w, dict(n_group=g, topk_group=tg, top_k=tk, scale=2.5)


def _assert_routes_equal(got, want):
    """Same expert set per token, weights per expert within rel 1e-5 (order is free)."""
    (ids, wts), (rids, rwts) = got, want
    assert ids.dtype == torch.int64 and wts.dtype == torch.float32 and ids.shape == rids.shape
    o, ro = ids.argsort(-1), rids.argsort(-1)
    assert torch.equal(ids.gather(1, o), rids.gather(1, ro)), "different expert sets"
    torch.testing.assert_close(wts.gather(1, o), rwts.gather(1, ro), rtol=1e-5, atol=0)


def test_route_bf16x3_split_is_exact():
    g = torch.Generator().manual_seed(0)
    mantissas = torch.randn(64, 48, generator=g)
    mantissas = mantissas.sign() * mantissas.abs().clamp(min=0.5)  # |W| >= 5e-31: the exact domain
    w = mantissas * torch.logspace(-30, 30, 48)  # a wide range of exponents
    s = route_select.prepare_router({"weight": w, "bias": torch.zeros(64)})["bf16x3"].float()
    assert torch.equal(s[0] + s[1] + s[2], w)


@pytest.mark.parametrize("config", range(len(route_triton.CONFIGS)))
@pytest.mark.parametrize("n", ROUTE_N)
@pytest.mark.parametrize("shape", ["tiny", "e256", "long"])
def test_route_matches_reference(shape, n, config):
    x, w, kw = _route_case(shape, n, seed=n)
    v = get("route", "triton")
    got = v.at(v.configs[config])(x, v.prepare_weights(w), **kw)
    _assert_routes_equal(got, reference("route").fn(x, w, **kw))


def test_route_fused_select_leaves_its_counter_at_zero():
    """fused_select: the GEMV's last program selects and resets the arrival counter, so calls in a row
    (a graph replaying the step, no memset between) route right each time."""
    from workbench.variants.kernels import arrivals as _arrivals

    fused = [c for c in route_triton.CONFIGS if c["fused_select"]]
    assert fused
    v = get("route", "triton")
    for cfg in fused:
        for n in (1, 5, 1):
            x, w, kw = _route_case("e256", n, seed=n)
            _assert_routes_equal(v.at(cfg)(x, v.prepare_weights(w), **kw), reference("route").fn(x, w, **kw))
    assert not _arrivals.COUNTERS[(torch.device("cpu"), "route")].any()


@pytest.mark.parametrize("config", SELECTIONS)
@pytest.mark.parametrize("n", [1, 6])
def test_route_nan_rows_still_select_top_k_distinct_experts(n, config):
    """A NaN activation row must not leave ids unwritten: the experts would gather out of bounds."""
    x, w, kw = _route_case("e256", n, seed=3)
    x[0] = float("nan")
    v = get("route", "triton")
    ids, wts = v.at(route_triton.CONFIGS[config])(x, v.prepare_weights(w), **kw)
    assert ((ids >= 0) & (ids < 256)).all()
    assert all(len(set(row.tolist())) == kw["top_k"] for row in ids)
    assert wts[0].isnan().all()
    if n > 1:
        _assert_routes_equal((ids[1:], wts[1:]), reference("route").fn(x[1:], w, **kw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", ROUTE_N)
def test_route_other_activation_dtypes(n, dtype):
    x, w, kw = _route_case("e256", n, dtype, seed=7 + n)
    v = get("route", "triton")
    _assert_routes_equal(v.fn(x, v.prepare_weights(w), **kw), reference("route").fn(x, w, **kw))


def _identity_router(scores, bias):
    """Router inputs whose sigmoid scores are `scores` [N, E]: weight = I, x = logit(scores)."""
    x = torch.log(scores / (1 - scores)).float()
    return x, {"weight": torch.eye(scores.shape[1]), "bias": bias.float()}


def _boundary_gap(biased, g, tg, tk):
    """FP64 margin of the decisions: kept vs dropped group score, chosen vs next expert."""
    gs = biased.view(g, -1).topk(2, dim=-1).values.sum(-1).sort(descending=True).values
    kept = biased.view(g, -1).topk(2, dim=-1).values.sum(-1).topk(tg).indices
    mask = torch.zeros(g, dtype=torch.bool)
    mask[kept] = True
    cand = biased.masked_fill(~mask.repeat_interleave(biased.numel() // g), -math.inf)
    es = cand.sort(descending=True).values
    return min(gs[tg - 1] - gs[tg] if tg < g else math.inf, es[tk - 1] - es[tk])


@pytest.mark.parametrize("config", SELECTIONS)
@pytest.mark.parametrize("n", ROUTE_N)
@pytest.mark.parametrize("shape", ["tiny", "e256"])
def test_route_near_ties(shape, n, config):
    """Scores and bias on a 2e-6 grid in a narrow band: every decision is a near-tie. Tokens whose
    FP64 margin is at least 1e-6 (15 FP32 ulps at 0.5) must select exactly the reference's experts."""
    e, g, tg, tk, _ = ROUTE_SHAPES[shape]
    gen = torch.Generator().manual_seed(100 + n)
    step = 2e-6
    bias = step * torch.randint(-4, 5, (e,), generator=gen).double()
    rows = []
    while len(rows) < n:
        x, w = _identity_router(0.5 + step * torch.randint(0, 3 * e, (1, e), generator=gen).double(), bias)
        if _boundary_gap((torch.sigmoid(x.double()) + w["bias"].double())[0], g, tg, tk) >= 1e-6:
            rows.append(x)
    x, kw = torch.cat(rows), dict(n_group=g, topk_group=tg, top_k=tk, scale=2.5)
    v = get("route", "triton")
    got = v.at(route_triton.CONFIGS[config])(x, v.prepare_weights(w), **kw)
    _assert_routes_equal(got, reference("route").fn(x, w, **kw))


@pytest.mark.parametrize("n", [1, 24])
@pytest.mark.parametrize("config", SELECTIONS)
def test_route_exact_tie_order(config, n):
    """Exact ties (equal scores, equal group sums) go to the lowest group, then the lowest expert."""
    e, g, tg, tk, _ = ROUTE_SHAPES["tiny"]
    gen = torch.Generator().manual_seed(5)
    values = torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64)
    scores = values[torch.randint(0, 3, (n, e), generator=gen)]
    x, w = _identity_router(scores, torch.zeros(e))
    v = get("route", "triton")
    ids, _ = v.at(route_triton.CONFIGS[config])(x, v.prepare_weights(w), n_group=g, topk_group=tg, top_k=tk,
                                                  scale=2.5)
    s = torch.sigmoid(x)  # biased == s (zero bias); stable sorts: lowest index first among equals
    gs = s.view(-1, g, e // g).sort(dim=-1, descending=True, stable=True).values[..., :2].sum(-1)
    groups = gs.sort(dim=-1, descending=True, stable=True).indices[:, :tg]
    mask = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, groups, True).repeat_interleave(e // g, 1)
    want = s.masked_fill(~mask, -1.0).sort(dim=-1, descending=True, stable=True).indices[:, :tk]
    assert torch.equal(ids.sort(-1).values, want.sort(-1).values)


# ====================================================================== head

def _head_case(n, dtype, hidden=64, vocab=288, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = {"norm": (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype),
         "lm_head": (torch.randn(vocab, hidden, generator=gen) * 10 / math.sqrt(hidden)).to(dtype)}
    return torch.randn(n, hidden, generator=gen).to(dtype), w


def _assert_head_close(out, ref, exact, dtype, hidden):
    """FP32: against the reference run in FP64 (`exact`), within FP32 rounding of a dot over `hidden`,
    4 sqrt(hidden) u max|logit| (a fixed 1e-5 against the FP32 reference failed on one machine's BLAS
    at hidden 600, where that reference itself was 1.75e-5 from FP64); TF32 or a stray BF16 rounding
    lands ~100x past it."""
    assert out.dtype == torch.float32 and out.shape == ref.shape
    if dtype == torch.float32:
        bound = 4 * math.sqrt(hidden) * 2 ** -24 * exact.abs().max().item()
        assert (out.double() - exact).abs().max().item() <= bound
    else:
        # Same rounding points as the reference: only a summation-order flip of the rounded GEMM
        # output (one ulp of the model dtype) may differ, on a few elements.
        torch.testing.assert_close(out, ref, rtol=2 ** -6 if dtype == torch.bfloat16 else 2 ** -9, atol=1e-4)
        assert ((out - ref).abs() > 1e-4).float().mean() < 0.02


@pytest.mark.parametrize("config", range(len(head_triton.CONFIGS)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_matches_reference(dtype, config):
    v = get("head", "triton")
    fn = v.at(v.configs[config])
    # GEMV up to gemv_max_tokens, tl.dot tiles above; hidden 600: several K steps with a masked tail.
    for n, hidden in ((1, 64), (3, 600), (8, 64), (40, 600)):
        h, w = _head_case(n, dtype, hidden=hidden, seed=n)
        exact = reference("head").fn(h.double(), {k: t.double() for k, t in w.items()}, eps=1e-6, softcap=30.0)
        _assert_head_close(fn(h, v.prepare_weights(w), eps=1e-6, softcap=30.0),
                           reference("head").fn(h, w, eps=1e-6, softcap=30.0), exact, dtype, hidden)


@pytest.mark.parametrize("config", range(len(head_softcap.CONFIGS)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_softcap_matches_reference(dtype, config):
    v = get("head", "triton_softcap")
    for n in (1, 40):
        h, w = _head_case(n, dtype, seed=n)
        out = v.at(v.configs[config])(h, w, eps=1e-6, softcap=30.0)
        torch.testing.assert_close(out, reference("head").fn(h, w, eps=1e-6, softcap=30.0), rtol=1e-6, atol=1e-5)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # exp(2|u|) = inf under numpy: intended
def test_head_softcap_saturates():
    """tanh branches: tiny, moderate and huge logits (exp overflow must give +-cap, not NaN)."""
    z = torch.tensor([[0.0, 1e-8, -3e-3, 2.0, -8.9, 9.1, 45.0, -300.0, 1e30, -1e30]])
    out = torch.empty_like(z)
    head_softcap._softcap_kernel[(1,)](z, out, z.numel(), 30.0, BLOCK=16)
    torch.testing.assert_close(out, 30.0 * torch.tanh(z.double() / 30.0).float(), rtol=1e-6, atol=1e-7)


# ====================================================================== sample

SMALL_BLOCK = dict(block=64, num_warps=4)  # several chunks per pass, a masked tail at vocab 300


def _sample(logits, temperature, top_k, top_p, seed, config=None):
    v = get("sample", "triton")
    return v.at(config)(logits, temperature, top_k, top_p, generator=torch.Generator().manual_seed(seed))


def _rows(n, t, k, p):
    return torch.full((n,), float(t)), torch.full((n,), k, dtype=torch.int64), torch.full((n,), float(p))


@pytest.mark.parametrize("config", get("sample", "triton").configs + [SMALL_BLOCK])
def test_sample_greedy_rows_exact(config):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 300, generator=gen) * 4
    logits[1, [17, 200, 250]] = logits[1].max() + 1.0  # tied maxima (three chunks apart at block 64):
    # the lowest index, as torch.argmax
    temperature = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.7, 0.0])
    top_k, top_p = torch.tensor([0, 3, 0, 50, 5, 0]), torch.tensor([1.0, 0.5, 0.9, 1.0, 0.8, 0.3])
    ids = _sample(logits, temperature, top_k, top_p, seed=0, config=config)
    greedy = temperature == 0
    assert ids.dtype == torch.int64 and torch.equal(ids[greedy], logits.argmax(-1)[greedy])
    assert int(ids[1]) == 17


def test_sample_seed_reproduces():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 300, generator=gen) * 2
    args = (logits, *_rows(8, 1.0, 40, 0.9))
    a, b, c = _sample(*args, seed=11), _sample(*args, seed=11), _sample(*args, seed=12)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(_sample(*args, seed=11, config=SMALL_BLOCK), a)  # chunking does not change the draw


def test_sample_top_k_1_is_argmax():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(12, 300, generator=gen) * 3
    for t, p, config in ((1.0, 1.0, None), (2.5, 0.3, SMALL_BLOCK)):
        assert torch.equal(_sample(logits, *_rows(12, t, 1, p), seed=4, config=config), logits.argmax(-1))


# Block 8 at vocab 10: two chunks per pass (cross-chunk sums and arg-max); top-k cases (dearer under
# the interpreter: one pass per bisection step) at the default config.
@pytest.mark.parametrize("t, k, p, draws, config", [(0.8, 0, 1.0, 400, dict(block=8, num_warps=1)),
                                                    (1.2, 0, 0.7, 300, dict(block=8, num_warps=1)),
                                                    (1.0, 4, 1.0, 200, None), (1.0, 6, 0.8, 160, None)])
def test_sample_distribution(t, k, p, draws, config):
    """Draws land only on the top-k / top-p support and follow softmax(logits / T) there (chi-square)."""
    gen = torch.Generator().manual_seed(6)
    logits = (torch.randn(1, 10, generator=gen) * 1.5).repeat(draws, 1)
    temperature, top_k, top_p = _rows(draws, t, k, p)
    ids = _sample(logits, temperature, top_k, top_p, seed=7, config=config)
    probs = contract_probs(logits[:1], temperature[:1], top_k[:1], top_p[:1])[0]
    counts = torch.bincount(ids, minlength=10).double()
    assert counts[probs == 0].sum() == 0, "a draw outside the top-k / top-p support"
    support = probs > 0
    expected = draws * probs[support]
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    if df:  # Wilson-Hilferty critical value at ~1e-4: a right sampler fails once in 10^4 seeds
        crit = df * (1 - 2 / (9 * df) + 3.7 * math.sqrt(2 / (9 * df))) ** 3
        assert chi2 <= crit, f"chi-square {chi2:.1f} > {crit:.1f} over {df} dof"


# ====================================================================== registration

TRITON_VARIANTS = [("route", "triton"), ("head", "triton"), ("head", "triton_softcap"), ("sample", "triton")]


@pytest.mark.parametrize("point, name", TRITON_VARIANTS)
def test_default_is_first_config_and_supports(point, name):
    from workbench.points import Workload

    v = get(point, name)
    assert v.backend == "triton" and v.configs
    assert any(c.cell_contents is v.configs[0] for c in v.fn.__closure__)
    for preset in ("beam-tiny", "beam-501b-tp8"):
        for batch in (1, 8, 64, 512):
            assert v.supports(Workload(preset, batch=batch)) is True
    assert isinstance(v.supports(Workload("beam-tiny", dtype="fp8")), str) or point == "sample"


# ====================================================================== GPU

@pytest.mark.gpu
def test_gpu_route_regimes_agree_tp8():
    """The three GEMM regimes on the same tokens: identical expert sets, weights within 1e-5."""
    kw = dict(n_group=8, topk_group=4, top_k=8, scale=2.5)
    gen = torch.Generator().manual_seed(0)
    w = {"weight": torch.randn(256, 5120, generator=gen) / math.sqrt(5120),
         "bias": torch.randn(256, generator=gen) * 0.05}
    x = torch.randn(128, 5120, generator=gen).bfloat16()
    w, x = {k: t.cuda() for k, t in w.items()}, x.cuda()
    v = get("route", "triton")
    pw = v.prepare_weights(w)
    want = reference("route").fn(x, w, **kw)
    for lo, hi in ((0, 16), (16, 96), (0, 128)):  # each slice runs in the regime its size picks
        got = v.fn(x[lo:hi], pw, **kw)
        _assert_routes_equal(got, tuple(t[lo:hi] for t in want))


def test_route_selection_compiles_once_whatever_the_split_count(monkeypatch):
    """route:triton's tile regimes split K by a count that follows the shapes (the token count among
    them); the selection kernel takes the config's bound as its constexpr, so two counts of partials
    share one compile (serving met a ~1 s compile at each new count). Both route as the reference."""
    calls, kernel = [], route_triton.route_select

    class Recording:  # records (partials, SPLIT) of each launch, then launches
        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append((args[8], kw["SPLIT"])) or kernel[grid](*args, **kw)

    monkeypatch.setattr(route_triton, "route_select", Recording())
    v = get("route", "triton")
    for shape in ("e256", "long"):  # tensor-core tiles at 100 tokens: K 32 in 1 partial, K 3000 in 8
        x, w, kw = _route_case(shape, 100, seed=5)
        _assert_routes_equal(v.fn(x, v.prepare_weights(w), **kw), reference("route").fn(x, w, **kw))
    (split_a, bound_a), (split_b, bound_b) = calls
    assert (split_a, split_b) == (1, 8) and bound_a == bound_b == route_triton.CONFIGS[0]["tc_split"]
