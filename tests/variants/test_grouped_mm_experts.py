"""`experts:grouped_mm`: pairs sorted by expert through torch._grouped_mm, SwiGLU and the weighted
combine in Triton. Against the reference in FP64, rounding each pair's output as the reference does,
deterministic, never reading unselected experts, grouping on the device (capturable), and skipped
where the GEMV path runs. CPU: torch's CPU grouped GEMM and the interpreted kernels at beam-tiny shapes."""

import pytest
import torch

pytest.importorskip("triton")

from tests.variants.test_triton_moe import TOL, _problem, _rel_err, _truth  # noqa: E402
from tests.variants.test_triton_moe_rounded import (  # noqa: E402
    GROUPED_PAIRS,
    TP8,
    _contract,
    assert_deterministic_and_reads_only_selected_experts,
)
from workbench.points import Workload  # noqa: E402
from workbench.registry import get  # noqa: E402

GROUPED_MM = get("experts", "grouped_mm")


@pytest.mark.parametrize("n", [GROUPED_PAIRS, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_reference(n, dtype):
    x, ids, weights, w = _problem(n, dtype, seed=n)
    y = GROUPED_MM.fn(x, ids, weights, w)
    assert y.shape == x.shape and y.dtype == dtype
    assert _rel_err(y, _truth(x, ids, weights, w)) < TOL[dtype]


def test_rounds_like_the_reference():
    """Gate, up and each pair's output are rounded to BF16 as the reference's BF16 GEMMs round them:
    the result sits far nearer that emulation than one keeping the pairs' rows exact."""
    x, ids, weights, w = _problem(GROUPED_PAIRS, torch.bfloat16, seed=4)
    rounded, exact_rows = (_contract(x, ids, weights, w, round_pairs=r, round_gate_up=True) for r in (True, False))
    y = GROUPED_MM.fn(x, ids, weights, w)
    assert _rel_err(y, rounded) < 0.2 * _rel_err(y, exact_rows)


def test_deterministic_and_never_reads_unselected_experts():
    assert_deterministic_and_reads_only_selected_experts(GROUPED_MM.fn)


def test_the_search_times_it_only_where_pairs_are_grouped():
    tiny = Workload(preset="beam-tiny", dtype="bf16")
    assert "GEMV path" in GROUPED_MM.supports(tiny)
    assert GROUPED_MM.supports(tiny.with_(batch=8, tokens_per_seq=64, context=64)) is True
    assert GROUPED_MM.fn(*_problem(0, torch.bfloat16)[:3], _problem(1, torch.bfloat16)[3]).shape == (0, 64)


@pytest.mark.gpu
def test_gpu_tp8_prefill_and_graph_capture():
    x, ids, weights, w = _problem(2048, torch.bfloat16, seed=1, hidden=TP8.hidden_size, ff=TP8.moe_intermediate_size,
                                  experts=TP8.n_routed_experts, top_k=TP8.num_experts_per_tok, device="cuda")
    y = GROUPED_MM.fn(x, ids, weights, w)
    assert _rel_err(y, _truth(x, ids, weights, w, torch.float32)) < TOL[torch.bfloat16]
    assert torch.equal(y, GROUPED_MM.fn(x, ids, weights, w))
    graph = torch.cuda.CUDAGraph()  # no host sync in the grouping
    with torch.cuda.graph(graph):
        captured = GROUPED_MM.fn(x, ids, weights, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, y)
