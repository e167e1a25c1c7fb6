"""`experts:triton_rounded`: experts:triton's grouped path with each pair's output rounded to the
model dtype (the reference's rounding) and weighted in the combine. Against the reference in FP64 at
every config, nearer the reference's own BF16 result than the FP32-row path, deterministic, never
reading unselected experts; decode shapes take the GEMV path. CPU: interpreted at beam-tiny shapes."""

import pytest
import torch

pytest.importorskip("triton")

from beam_model.config import BeamConfig  # noqa: E402
from tests.variants.test_triton_moe import TOL, _problem, _rel_err, _truth  # noqa: E402
from workbench.points import Workload  # noqa: E402
from workbench.registry import get  # noqa: E402
from workbench.variants.experts.triton_rounded import GROUPED_CONFIGS  # noqa: E402

ROUNDED = get("experts", "triton_rounded")
GROUPED_PAIRS = 17  # tokens: 68 pairs at beam-tiny's top_k 4, past the GEMV path's 64


def _name(config):
    return "auto" if config is None else "-".join(str(v) for k, v in config.items() if k not in ("path", "num_stages"))


@pytest.mark.parametrize("config", [None, *GROUPED_CONFIGS], ids=_name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_reference(config, dtype):
    x, ids, weights, w = _problem(GROUPED_PAIRS, dtype, seed=3)
    y = ROUNDED.at(config)(x, ids, weights, w)
    assert y.shape == x.shape and y.dtype == dtype
    assert _rel_err(y, _truth(x, ids, weights, w)) < TOL[dtype]


def _contract(x, ids, weights, w, *, round_pairs, round_gate_up=False):
    """The experts math in FP64 with the activation rounded to BF16 and, optionally, each pair's down
    projection too (the contract's 'each expert's GEMMs in the model dtype') and gate and up (as
    BF16 GEMMs round them), the combine rounded once."""
    d = {k: v.double() for k, v in w.items()}
    g = torch.einsum("nh,nkfh->nkf", x.double(), d["gate_proj"][ids])
    u = torch.einsum("nh,nkfh->nkf", x.double(), d["up_proj"][ids])
    if round_gate_up:
        g, u = g.bfloat16().double(), u.bfloat16().double()
    act = (torch.nn.functional.silu(g) * u).bfloat16().double()
    pairs = torch.einsum("nkf,nkhf->nkh", act, d["down_proj"][ids])
    if round_pairs:
        pairs = pairs.bfloat16().double()
    return (pairs * weights.double()[..., None]).sum(1).bfloat16()


def test_rounds_each_pair_to_the_model_dtype():
    """This variant's rows are rounded before the combine; experts:triton's stay FP32. Each matches
    its own emulation (FP32 accumulation order aside) and is ~1 BF16 rounding from the other's."""
    x, ids, weights, w = _problem(GROUPED_PAIRS, torch.bfloat16, seed=4)
    rounded = _contract(x, ids, weights, w, round_pairs=True)
    fp32_rows = _contract(x, ids, weights, w, round_pairs=False)
    config = GROUPED_CONFIGS[0]
    y, y_triton = ROUNDED.at(config)(x, ids, weights, w), get("experts", "triton").at(config)(x, ids, weights, w)
    assert _rel_err(y, rounded) < 0.1 * _rel_err(y, fp32_rows)
    assert _rel_err(y_triton, fp32_rows) < 0.1 * _rel_err(y_triton, rounded)


def assert_deterministic_and_reads_only_selected_experts(fn):
    """Experts 0-3 and 5 are selected; 4 (empty between used ones) and 6+ hold NaN: never read."""
    x, _, weights, w = _problem(GROUPED_PAIRS, torch.bfloat16, seed=9)
    ids = torch.stack([torch.tensor([5, i % 4, (i + 1) % 4, (i + 2) % 4]) for i in range(GROUPED_PAIRS)])
    poisoned = {k: v.clone() for k, v in w.items()}
    for v in poisoned.values():
        v[4] = v[6:] = float("nan")
    first = fn(x, ids, weights, poisoned)
    assert torch.isfinite(first).all()
    assert torch.equal(first.view(torch.int16), fn(x, ids, weights, poisoned).view(torch.int16))


def test_deterministic_and_never_reads_unselected_experts():
    assert_deterministic_and_reads_only_selected_experts(ROUNDED.fn)


def test_decode_takes_the_gemv_path_and_the_search_skips_it():
    x, ids, weights, w = _problem(3, torch.float32, seed=2)
    assert torch.equal(ROUNDED.fn(x, ids, weights, w), get("experts", "triton").fn(x, ids, weights, w))
    assert "GEMV path" in ROUNDED.supports(Workload(preset="beam-tiny", dtype="bf16"))
    assert ROUNDED.supports(Workload(preset="beam-tiny", dtype="bf16").with_(batch=8, tokens_per_seq=64,
                                                                             context=64)) is True


TP8 = BeamConfig.from_preset("beam-501b-tp8")


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, *GROUPED_CONFIGS], ids=_name)
def test_gpu_tp8_prefill(config):
    shape = dict(hidden=TP8.hidden_size, ff=TP8.moe_intermediate_size, experts=TP8.n_routed_experts,
                 top_k=TP8.num_experts_per_tok, device="cuda")
    x, ids, weights, w = _problem(2048, torch.bfloat16, seed=1, **shape)
    y = ROUNDED.at(config)(x, ids, weights, w)
    assert _rel_err(y, _truth(x, ids, weights, w, torch.float32)) < TOL[torch.bfloat16]
    assert torch.equal(y, ROUNDED.at(config)(x, ids, weights, w))
