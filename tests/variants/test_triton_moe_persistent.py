"""`experts:triton_persistent`: experts:triton_rows' decode GEMVs in one launch with a grid barrier. CPU:
interpreted at beam-tiny shapes, where the two phases run as two launches of the same kernel (the
interpreter runs programs one after another, so a barrier would wait forever); against the reference
in FP64, units left over at the end of a program's stride, bitwise agreement with experts:triton_rows,
only the selected experts read. `-m gpu`: the one-launch form at the TP8 rank's shapes, repeated (the
barrier resets itself), with PDL, and in a CUDA graph."""

import pytest
import torch

pytest.importorskip("triton")

from tests.variants.test_triton_moe import TOL, TP8, _poisoned, _problem, _rel_err, _truth, _unselected  # noqa: E402
from workbench.points import Workload  # noqa: E402
from workbench.registry import get  # noqa: E402
from workbench.variants.experts.triton_persistent import CONFIGS  # noqa: E402
from workbench.variants.kernels.arrivals import arrival_counters  # noqa: E402

PERSISTENT = get("experts", "triton_persistent")


def _name(config):
    return "-".join(f"{k}{v}" for k, v in config.items())


@pytest.mark.parametrize("config", CONFIGS, ids=_name)
def test_matches_reference(config):
    x, ids, weights, w = _problem(1, torch.bfloat16, seed=2)
    y = PERSISTENT.at(config)(x, ids, weights, w)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert _rel_err(y, _truth(x, ids, weights, w)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("hidden, ff", [(80, 48), (70, 44)], ids=["exact-rest", "masked-rest"])
def test_units_past_a_program_s_stride(hidden, ff):
    """More units than programs, not a multiple of them (4 interpreted "SMs" x 7): gate/up 2 tokens x 3
    experts x 6 blocks of 8 rows = 36 units (the last block of 44 rows ragged), down 2 x 20 or 2 x 18
    blocks of 4 hidden rows (the last of 70 ragged); rows as a power of two plus a rest (80 = 64 + 16)
    or a masked one (70 = 64 + 8 lanes, 44 = 32 + 16)."""
    x, ids, weights, w = _problem(2, torch.float32, seed=11, hidden=hidden, ff=ff, experts=10, top_k=3)
    config = dict(BLOCK_N=8, DOWN_BLOCK_N=4, num_warps=2, PER_SM=7)
    assert _rel_err(PERSISTENT.at(config)(x, ids, weights, w), _truth(x, ids, weights, w)) < TOL[torch.float32]


def test_bitwise_as_triton_rows_and_reads_only_its_experts():
    """Each row is reduced as experts:triton_rows reduces it at the same tiles: the same bits."""
    x, ids, weights, w = _problem(1, torch.bfloat16, seed=7)
    clean = PERSISTENT.fn(x, ids, weights, w)
    rows = get("experts", "triton_rows").at(dict(BLOCK_N=1, num_warps=8, DOWN_BLOCK_N=2, DOWN_WARPS=8))
    assert torch.equal(clean.view(torch.int16), rows(x, ids, weights, w).view(torch.int16))
    poisoned = _poisoned(w, _unselected(ids[0]))
    assert torch.equal(PERSISTENT.fn(x, ids, weights, poisoned), clean)


def test_past_the_gemv_pairs_takes_experts_triton():
    x, ids, weights, w = _problem(17, torch.bfloat16, seed=3)  # 68 pairs
    assert torch.equal(PERSISTENT.fn(x, ids, weights, w), get("experts", "triton").fn(x, ids, weights, w))


def test_supports():
    assert PERSISTENT.supports(Workload("beam-501b-tp8", batch=1, context=4096)) is True
    prefill = Workload("beam-501b-tp8", batch=8, tokens_per_seq=2048, context=2048)
    assert "grouped path" in PERSISTENT.supports(prefill)


def _tp8(seed, n=1):
    return _problem(n, torch.bfloat16, seed=seed, hidden=TP8.hidden_size, ff=TP8.moe_intermediate_size,
                    experts=TP8.n_routed_experts, top_k=TP8.num_experts_per_tok, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS, ids=_name)
@pytest.mark.parametrize("n", [1, 8])
def test_gpu_tp8(config, n):
    """One launch, barrier included, at and without PDL; ten launches in a row give the same bits (the
    barrier's counters are back at 0 after each)."""
    x, ids, weights, w = _tp8(n, n)
    truth = _truth(x, ids, weights, w, torch.float32)
    for cfg in (config, dict(config, pdl=True)):
        y = PERSISTENT.at(cfg)(x, ids, weights, w)
        assert _rel_err(y, truth) < TOL[torch.bfloat16]
        for _ in range(10):
            assert torch.equal(y, PERSISTENT.at(cfg)(x, ids, weights, w))
        assert not arrival_counters(2, x.device, "experts_persistent")[:2].any()


@pytest.mark.gpu
def test_gpu_cuda_graph():
    """With PDL, in a CUDA graph, on routing written after the capture: as eager without PDL."""
    x, ids, weights, w = _tp8(1)
    fn = PERSISTENT.at(dict(CONFIGS[0], pdl=True))
    fn(x, ids, weights, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fn(x, ids, weights, w)
    x2, ids2, weights2, _ = _tp8(2)
    x.copy_(x2), ids.copy_(ids2), weights.copy_(weights2)
    for _ in range(3):
        graph.replay()
        assert torch.equal(y, PERSISTENT.at(CONFIGS[0])(x2, ids2, weights2, w))
