"""`experts:grouped_mm`: pairs sorted by expert through torch._grouped_mm, SwiGLU and the weighted
combine in Triton. Against the reference in FP64, rounding each pair's output as the reference does,
deterministic, never reading unselected experts, grouping on the device (capturable), and skipped
where the GEMV path runs. CPU: torch's CPU grouped GEMM and the interpreted kernels at beam-tiny shapes."""

import pytest
import torch

pytest.importorskip("triton")

from tests.test_triton_moe import TOL, _problem, _rel_err, _truth  # noqa: E402
from tests.test_triton_moe_rounded import GROUPED_PAIRS, TP8  # noqa: E402
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


def _contract(x, ids, weights, w, *, round_pairs):
    """The reference's roundings in FP64: gate and up (BF16 GEMMs), the activation, optionally each
    pair's down projection; the combine rounded once."""
    d = {k: v.double() for k, v in w.items()}
    g = torch.einsum("nh,nkfh->nkf", x.double(), d["gate_proj"][ids]).bfloat16().double()
    u = torch.einsum("nh,nkfh->nkf", x.double(), d["up_proj"][ids]).bfloat16().double()
    act = (torch.nn.functional.silu(g) * u).bfloat16().double()
    pairs = torch.einsum("nkf,nkhf->nkh", act, d["down_proj"][ids])
    if round_pairs:
        pairs = pairs.bfloat16().double()
    return (pairs * weights.double()[..., None]).sum(1).bfloat16()


def test_rounds_like_the_reference():
    """Gate, up and each pair's output are rounded to BF16 as the reference's BF16 GEMMs round them:
    the result sits far nearer that emulation than one keeping the pairs' rows exact."""
    x, ids, weights, w = _problem(GROUPED_PAIRS, torch.bfloat16, seed=4)
    rounded, exact_rows = _contract(x, ids, weights, w, round_pairs=True), _contract(x, ids, weights, w, round_pairs=False)
    y = GROUPED_MM.fn(x, ids, weights, w)
    assert _rel_err(y, rounded) < 0.2 * _rel_err(y, exact_rows)


def test_deterministic_and_never_reads_unselected_experts():
    x, _, weights, w = _problem(GROUPED_PAIRS, torch.bfloat16, seed=9)
    ids = torch.stack([torch.tensor([5, i % 4, (i + 1) % 4, (i + 2) % 4]) for i in range(GROUPED_PAIRS)])
    poisoned = {k: v.clone() for k, v in w.items()}
    for v in poisoned.values():
        v[6:] = float("nan")
        v[4] = float("nan")  # an empty expert between used ones
    first = GROUPED_MM.fn(x, ids, weights, poisoned)
    assert torch.isfinite(first).all()
    assert torch.equal(first.view(torch.int16), GROUPED_MM.fn(x, ids, weights, poisoned).view(torch.int16))


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
