"""`experts:triton_rows`: the decode GEMV with whole weight rows per program. Every config against the
reference in FP64, rows split into a power of two plus a (masked) rest, bitwise determinism, only the
selected experts read, and past the GEMV's pairs experts:triton's own path. CPU: interpreted at
beam-tiny shapes; `-m gpu`: compiled at the TP8 rank's shapes, also in a CUDA graph."""

import pytest
import torch

pytest.importorskip("triton")

from tests.variants.test_triton_moe import TOL, TP8, _poisoned, _problem, _rel_err, _truth, _unselected  # noqa: E402
from workbench.points import Workload  # noqa: E402
from workbench.registry import get  # noqa: E402
from workbench.variants.experts.triton_rows import CONFIGS  # noqa: E402
from workbench.variants.kernels.moe_rows import pieces  # noqa: E402

ROWS = get("experts", "triton_rows")
LOOPED = next(c for c in CONFIGS if "BLOCK_K" in c)  # experts:triton's gate/up kernel, then down_rows_kernel


def _name(config):
    return "-".join(f"{k}{v}" for k, v in config.items())


@pytest.mark.parametrize("config", CONFIGS, ids=_name)
def test_matches_reference(config):
    """BF16 at every config, one token (FP32 and more tokens: `test_rows_in_two_pieces`; each
    interpreted program costs CPU time, and the kernels' code is the same)."""
    x, ids, weights, w = _problem(1, torch.bfloat16, seed=2)
    y = ROWS.at(config)(x, ids, weights, w)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert _rel_err(y, _truth(x, ids, weights, w)) < TOL[torch.bfloat16]


def test_pieces():
    assert [pieces(n) for n in (5120, 320, 2560, 64, 70, 1)] == [(4096, 1024), (256, 64), (2048, 512), (64, 1),
                                                                 (64, 8), (1, 1)]


@pytest.mark.parametrize("hidden, ff", [(80, 48), (70, 40)], ids=["exact-rest", "masked-rest"])
def test_rows_in_two_pieces(hidden, ff):
    """hidden and ff past a power of two: the rest is a second piece (80 = 64 + 16), or a masked one
    (70 = 64 + 8 lanes, 2 of them past the row); odd experts and top_k too. Configs: one block a
    program, the looped gate/up, and 3 double-buffered blocks of 2 rows, where the last program's
    rows end inside its blocks (48 = 8 x 6, 40 = 6 x 6 + 4; 80 = 13 x 6 + 2, 70 = 11 x 6 + 4)."""
    x, ids, weights, w = _problem(2, torch.float32, seed=11, hidden=hidden, ff=ff, experts=10, top_k=3)
    ragged = dict(BLOCK_N=2, num_warps=4, STEPS=3, DOWN_BLOCK_N=2, DOWN_WARPS=2, DOWN_STEPS=3)
    for config in (CONFIGS[0], LOOPED, ragged):
        assert _rel_err(ROWS.at(config)(x, ids, weights, w), _truth(x, ids, weights, w)) < TOL[torch.float32]


def test_bitwise_deterministic_and_reads_only_its_experts():
    x, ids, weights, w = _problem(1, torch.bfloat16, seed=7)
    clean = ROWS.fn(x, ids, weights, w)
    assert torch.equal(clean.view(torch.int16), ROWS.fn(x, ids, weights, w).view(torch.int16))
    poisoned = _poisoned(w, _unselected(ids[0]))
    assert torch.equal(ROWS.fn(x, ids, weights, poisoned), clean)


def test_past_the_gemv_pairs_takes_experts_triton():
    x, ids, weights, w = _problem(17, torch.bfloat16, seed=3)  # 68 pairs
    assert torch.equal(ROWS.fn(x, ids, weights, w), get("experts", "triton").fn(x, ids, weights, w))


def test_supports():
    decode = Workload("beam-501b-tp8", batch=1, context=4096)
    prefill = Workload("beam-501b-tp8", batch=8, tokens_per_seq=2048, context=2048)
    assert ROWS.supports(decode) is True
    assert "grouped path" in ROWS.supports(prefill)
    for config in CONFIGS:  # each config fits its registers at the shapes it was made for
        assert ROWS.config_supports(config, decode) is True
    too_wide = dict(CONFIGS[0], BLOCK_N=8)  # 8 whole rows of 5120 at 8 warps: 320 elements a thread
    assert "spill" in ROWS.config_supports(too_wide, decode)


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS, ids=_name)
@pytest.mark.parametrize("n", [1, 8])
def test_gpu_tp8(config, n):
    x, ids, weights, w = _problem(n, torch.bfloat16, seed=n, hidden=TP8.hidden_size, ff=TP8.moe_intermediate_size,
                                  experts=TP8.n_routed_experts, top_k=TP8.num_experts_per_tok, device="cuda")
    for cfg in (config, dict(config, pdl=True)):
        y = ROWS.at(cfg)(x, ids, weights, w)
        assert _rel_err(y, _truth(x, ids, weights, w, torch.float32)) < TOL[torch.bfloat16]
        assert torch.equal(y, ROWS.at(cfg)(x, ids, weights, w))


@pytest.mark.gpu
def test_gpu_cuda_graph():
    """With PDL, in a CUDA graph, on routing written after the capture: as eager without PDL."""
    def problem(seed):
        return _problem(1, torch.bfloat16, seed=seed, hidden=TP8.hidden_size, ff=TP8.moe_intermediate_size,
                        experts=TP8.n_routed_experts, top_k=TP8.num_experts_per_tok, device="cuda")

    x, ids, weights, w = problem(1)
    fn = ROWS.at(dict(CONFIGS[0], pdl=True))
    fn(x, ids, weights, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fn(x, ids, weights, w)
    x2, ids2, weights2, _ = problem(2)
    x.copy_(x2), ids.copy_(ids2), weights.copy_(weights2)
    graph.replay()
    assert torch.equal(y, ROWS.at(CONFIGS[0])(x2, ids2, weights2, w))
