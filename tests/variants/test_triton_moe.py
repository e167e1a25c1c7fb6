"""`experts:triton`, the fused MoE: both paths (GEMV, grouped) at every tuning config against the
reference run in FP64, plus the properties the gates and the server rely on: bitwise run-to-run
determinism, only the selected experts read at one token, empty and overfull experts, device-side
grouping. CPU tests run the kernels under the Triton interpreter at beam-tiny shapes; `-m gpu` runs
them compiled at the TP8 rank's shapes."""

import pytest
import torch

pytest.importorskip("triton")

from beam_model.config import BeamConfig  # noqa: E402
from workbench.registry import get  # noqa: E402
from workbench.variants.experts import experts as reference  # noqa: E402
from workbench.variants.experts.triton import CONFIGS as TRITON_CONFIGS  # noqa: E402
from workbench.variants.kernels import moe as _triton_moe  # noqa: E402  (conftest has set TRITON_INTERPRET)

TINY = BeamConfig.from_preset("beam-tiny")  # hidden 64, ff 32, 16 experts, top_k 4
# The reference itself is ~4e-3 off in bf16 (it rounds gate, up and each expert's output); rounding
# only act and y, the kernels land near 2.5e-3, so 5e-3 still catches a stray extra rounding.
TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-3}
GEMV = next(c for c in TRITON_CONFIGS if c["path"] == "gemv")
GROUPED = next(c for c in TRITON_CONFIGS if c["path"] == "grouped")


def _problem(n, dtype, *, seed=0, hidden=TINY.hidden_size, ff=TINY.moe_intermediate_size,
             experts=TINY.n_routed_experts, top_k=TINY.num_experts_per_tok, device="cpu"):
    g = torch.Generator(device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=g, device=device) * scale).to(dtype)

    w = {"gate_proj": randn(experts, ff, hidden, scale=hidden ** -0.5),
         "up_proj": randn(experts, ff, hidden, scale=hidden ** -0.5),
         "down_proj": randn(experts, hidden, ff, scale=ff ** -0.5)}
    ids = torch.rand(n, experts, generator=g, device=device).topk(top_k, dim=-1).indices
    weights = torch.rand(n, top_k, generator=g, device=device) + 0.1
    return randn(n, hidden), ids, weights, w


def _truth(x, ids, weights, w, dtype=torch.float64):
    return reference(x.to(dtype), ids, weights.to(dtype), {k: v.to(dtype) for k, v in w.items()})


def _poisoned(w, experts):
    """A copy of the weights with NaN in `experts` (indices or a mask): no kernel may read them."""
    out = {k: v.clone() for k, v in w.items()}
    for v in out.values():
        v[experts] = float("nan")
    return out


def _unselected(ids):
    """The mask of the experts a token's `ids` do not select."""
    mask = torch.ones(TINY.n_routed_experts, dtype=torch.bool)
    mask[ids] = False
    return mask


def _rel_err(y, ref):
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def _run(config, x, ids, weights, w):
    return get("experts", "triton").at(config)(x, ids, weights, w)


def _name(config):
    if config is None:
        return "auto"
    return "-".join(str(v) for k, v in config.items() if k != "num_stages")


# Every config at 1 and 3 tokens; at 17 (68 pairs: past the GEMV's own limit, where only a forced config
# runs it) the grouped configs and one GEMV config: the others differ from it only in tiles, which the
# smaller cases cover, and each interpreted GEMV case there costs ~10 s of the CPU suite.
CASES = [(c, n) for c in [None, *TRITON_CONFIGS] for n in (1, 3, 17)
         if n < 17 or not c or c["path"] == "grouped" or c is GEMV]


@pytest.mark.parametrize("config, n", CASES, ids=[f"{_name(c)}-{n}" for c, n in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_reference(config, n, dtype):
    x, ids, weights, w = _problem(n, dtype, seed=n)
    y = _run(config, x, ids, weights, w)
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
    assert _rel_err(y, _truth(x, ids, weights, w)) < TOL[dtype]


def test_defaults_are_tuning_configs():
    for default in (_triton_moe.GEMV, _triton_moe.GROUPED_SMALL, _triton_moe.GROUPED_LARGE):
        assert default in TRITON_CONFIGS


@pytest.mark.parametrize("config, n", [(GEMV, 3), (GROUPED, 17)], ids=["gemv", "grouped"])
def test_bitwise_deterministic(config, n):
    x, ids, weights, w = _problem(n, torch.bfloat16, seed=5)
    first = _run(config, x, ids, weights, w)
    assert torch.equal(first.view(torch.int16), _run(config, x, ids, weights, w).view(torch.int16))


@pytest.mark.parametrize("config", [GEMV, GROUPED], ids=["gemv", "grouped"])
def test_one_token_reads_only_its_experts(config):
    x, ids, weights, w = _problem(1, torch.bfloat16, seed=7)
    clean = _run(config, x, ids, weights, w)
    y = _run(config, x, ids, weights, _poisoned(w, _unselected(ids[0])))
    assert torch.isfinite(y).all() and torch.equal(y, clean)


@pytest.mark.parametrize("config", [GEMV, GROUPED], ids=["gemv", "grouped"])
def test_empty_and_overfull_experts(config):
    """Every token routes to expert 5 (17 rows: more than one BLOCK_M=16 block) and to experts 0..3
    only otherwise, so experts 6..15 get nothing; their weights are NaN and must never be read."""
    x, _, weights, w = _problem(17, torch.float32, seed=9)
    ids = torch.stack([torch.tensor([5, (i % 4), (i + 1) % 4, (i + 2) % 4]) for i in range(17)])
    y = _run(config, x, ids, weights, _poisoned(w, slice(6, None)))
    assert _rel_err(y, _truth(x, ids, weights, w)) < TOL[torch.float32]


@pytest.mark.parametrize("config", [GEMV, GROUPED], ids=["gemv", "grouped"])
def test_odd_shapes(config):
    """supports() accepts any shape: non-power-of-two hidden, ff, experts and top_k, all masked."""
    x, ids, weights, w = _problem(5, torch.float32, seed=11, hidden=80, ff=48, experts=10, top_k=3)
    assert _rel_err(_run(config, x, ids, weights, w), _truth(x, ids, weights, w)) < TOL[torch.float32]


# each split count once, each dtype once: interpreted, the four pairs took ~67 s of CI's ~16 minutes
@pytest.mark.parametrize("split,dtype", [(2, torch.float32), (4, torch.bfloat16)], ids=["2-fp32", "4-bf16"])
def test_gemv_split_k(split, dtype):
    """SPLIT_K: hidden 200 in 16-wide steps (13, the last one partial) cut into slices (7 + 6 steps, or
    4 + 4 + 4 + 1), the last program of each (pair, n-block) summing them; calls in a row leave the
    arrival counters at 0."""
    from workbench.variants.kernels import arrivals as _arrivals

    cfg = dict(GEMV, BLOCK_K=16, SPLIT_K=split)
    for seed in (1, 2):  # a second call reuses the counters the first left
        x, ids, weights, w = _problem(3, dtype, seed=seed, hidden=200, ff=48, experts=10, top_k=3)
        y, ref = _run(cfg, x, ids, weights, w), _truth(x, ids, weights, w)
        assert _rel_err(y, ref) < TOL[dtype]
        assert torch.equal(y, _run(cfg, x, ids, weights, w))
    assert not _arrivals.COUNTERS[(torch.device("cpu"), "experts")].any()


def test_grouped_down_gemm_takes_its_own_tile(monkeypatch):
    """DOWN_BLOCK_N / DOWN_BLOCK_K / DOWN_WARPS / DOWN_STAGES reach the grouped path's down kernel
    (hidden 80 in 32-wide tiles, ff 48 in 16-wide steps: both masked), and gate/up keeps its own."""
    launched = {}

    def spy(name):
        kernel = getattr(_triton_moe, name)

        class Spy:
            def __getitem__(self, grid):
                def launch(*args, **kw):
                    launched[name] = kw
                    return kernel[grid](*args, **kw)
                return launch
        monkeypatch.setattr(_triton_moe, name, Spy())

    spy("gate_up_grouped_kernel"), spy("down_grouped_kernel")
    cfg = dict(GROUPED, DOWN_BLOCK_N=32, DOWN_BLOCK_K=16, DOWN_WARPS=2, DOWN_STAGES=1)
    x, ids, weights, w = _problem(9, torch.float32, seed=4, hidden=80, ff=48, experts=10, top_k=3)
    assert _rel_err(_run(cfg, x, ids, weights, w), _truth(x, ids, weights, w)) < TOL[torch.float32]
    down, gate_up = launched["down_grouped_kernel"], launched["gate_up_grouped_kernel"]
    assert (down["BLOCK_N"], down["BLOCK_K"], down["num_warps"], down["num_stages"]) == (32, 16, 2, 1)
    assert (gate_up["BLOCK_N"], gate_up["BLOCK_K"], gate_up["num_warps"]) == \
        (GROUPED["BLOCK_N"], GROUPED["BLOCK_K"], GROUPED["num_warps"])


def test_gemv_configs_past_the_gemv_limit_are_not_timed_as_themselves():
    """Past GEMV_HARD_MAX_PAIRS a GEMV config runs the grouped default, so the search and bench skip
    it there with the reason instead of timing the default once per GEMV config (nine times at the
    8 x 2K prefill, runs/optimize-prefill-8x2k-beam-501b-tp8/search/experts.json)."""
    from workbench.points import Workload

    v = get("experts", "triton")
    top_k = TINY.num_experts_per_tok
    at_limit = Workload(preset="beam-tiny", batch=1, tokens_per_seq=_triton_moe.GEMV_HARD_MAX_PAIRS // top_k,
                        context=_triton_moe.GEMV_HARD_MAX_PAIRS // top_k)
    past = at_limit.with_(batch=2)
    assert v.unsupported_config(GEMV, at_limit) is None
    assert "grouped default" in v.unsupported_config(GEMV, past)
    assert v.unsupported_config(GROUPED, past) is None and v.unsupported_config(None, past) is None


def test_no_tokens():
    x, ids, weights, w = _problem(0, torch.bfloat16)
    assert _run(None, x, ids, weights, w).shape == (0, TINY.hidden_size)


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("tokens", [17, 300])
def test_align_by_expert(block_m, tokens):
    """The grouping kernels against the same grouping in plain torch (sort by expert, stable): one
    chunk of pairs, and three (each placed after the chunks before it, experts marked by several
    programs)."""
    experts, n_pairs = TINY.n_routed_experts, tokens * 4
    assert (n_pairs > 2 * _triton_moe.ALIGN_CHUNK) == (tokens == 300)
    ids = torch.randint(0, 6, (tokens, 4))  # experts 6.. empty, several experts over one block
    pairs, block_expert = _triton_moe.align_by_expert(ids, experts, block_m)
    counts = torch.bincount(ids.flatten(), minlength=experts)
    order = ids.flatten().argsort(stable=True)
    want_pairs, want_blocks, start = [], [], 0
    for e, c in enumerate(counts.tolist()):
        padded = -(-c // block_m) * block_m
        want_pairs += order[start:start + c].tolist() + [n_pairs] * (padded - c)
        want_blocks += [e] * (padded // block_m)
        start += c
    assert len(block_expert) * block_m == len(pairs) >= len(want_pairs)
    assert pairs[:len(want_pairs)].tolist() == want_pairs
    assert block_expert.tolist() == want_blocks + [experts] * (len(block_expert) - len(want_blocks))


# ---- on the GPU: the TP8 rank's shapes (hidden 5120, ff 320, 256 experts, top_k 8) ---------------

TP8 = BeamConfig.from_preset("beam-501b-tp8")


@pytest.fixture(scope="module")
def tp8_weights():
    x, ids, weights, w = _problem(1, torch.bfloat16, hidden=TP8.hidden_size, ff=TP8.moe_intermediate_size,
                                  experts=TP8.n_routed_experts, top_k=TP8.num_experts_per_tok, device="cuda")
    return w


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, *TRITON_CONFIGS], ids=_name)
@pytest.mark.parametrize("n", [1, 8, 64, 2048])
def test_gpu_tp8(config, n, tp8_weights):
    if config and config["path"] == "gemv" and n > 64:
        pytest.skip("GEMV configs re-read an expert per pair: not meant for prefill")
    x, ids, weights, _ = _problem(n, torch.bfloat16, seed=n, hidden=TP8.hidden_size, ff=TP8.moe_intermediate_size,
                                  experts=TP8.n_routed_experts, top_k=TP8.num_experts_per_tok, device="cuda")
    y = _run(config, x, ids, weights, tp8_weights)
    assert _rel_err(y, _truth(x, ids, weights, tp8_weights, torch.float32)) < TOL[torch.bfloat16]
    assert torch.equal(y, _run(config, x, ids, weights, tp8_weights))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 64])
def test_gpu_cuda_graph(n, tp8_weights):
    """No host sync anywhere: the whole call captures into a CUDA graph and replays on new routing."""
    x, ids, weights, _ = _problem(n, torch.bfloat16, seed=1, hidden=TP8.hidden_size, ff=TP8.moe_intermediate_size,
                                  experts=TP8.n_routed_experts, top_k=TP8.num_experts_per_tok, device="cuda")
    fn = get("experts", "triton").fn
    fn(x, ids, weights, tp8_weights)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fn(x, ids, weights, tp8_weights)
    x2, ids2, weights2, _ = _problem(n, torch.bfloat16, seed=2, hidden=TP8.hidden_size,
                                     ff=TP8.moe_intermediate_size, experts=TP8.n_routed_experts,
                                     top_k=TP8.num_experts_per_tok, device="cuda")
    x.copy_(x2), ids.copy_(ids2), weights.copy_(weights2)
    graph.replay()
    assert torch.equal(y, fn(x2, ids2, weights2, tp8_weights))
