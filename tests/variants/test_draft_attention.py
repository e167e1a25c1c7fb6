"""`draft_attention`: the drafter's block attention as a point. The reference is the attention the drafter
ran before the point existed, in FP32; `draft_attention:triton` reads the keys in place. Checked on the
CPU interpreter: every config through the op gate at a drafter's block of 16 rows (its splits and row
tiles crossing the keys and the block), keys that do not exist never read (NaN in their slots), and a
drafter's block logits the same through either variant. On the GPU: every config at beam-mini's and a
TP8 rank's draft step, and a CUDA-graph replay with new contents."""

import pytest
import torch

from tests.variants.helpers import assert_every_config_passes, available, needs_cuda
from workbench.points import Workload, spec

BLOCKS = [Workload("beam-tiny", batch=2, tokens_per_seq=16, context=200, dtype=dtype) for dtype in ("bf16", "fp32")]


def test_every_config_passes_the_op_gate_at_a_drafters_block():
    assert_every_config_passes(available("draft_attention", "triton"), BLOCKS, seeds=(0,))


@pytest.mark.parametrize("config", [0, 4], ids=["one-split", "eight-splits"])
def test_keys_that_do_not_exist_are_never_read(config):
    v = available("draft_attention", "triton")
    q, store, pages, offsets, mask = spec("draft_attention").inputs(BLOCKS[0], "cpu", 0).args
    mask[1, :40] = float("-inf")  # the second block's first 40 context keys do not exist
    want = v.at(v.configs[config])(q, store, pages, offsets, mask)
    poisoned = store.clone()
    poisoned[pages[1, :40], :, offsets[1, :40]] = float("nan")
    got = v.at(v.configs[config])(q, poisoned, pages, offsets, mask)
    assert torch.equal(got, want)


def test_a_drafters_block_logits_are_the_same_through_either_variant():
    from beam_model.drafter_config import DrafterConfig
    from beam_model.model import BeamForCausalLM
    from workbench.training.drafter import initial_drafter

    available("draft_attention", "triton")
    target = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32)
    drafter = initial_drafter(DrafterConfig.for_target(target.config), target, seed=0, device="cpu")
    ids = torch.randint(0, target.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    tapped = torch.randn(2, 40, drafter.config.feature_width, generator=torch.Generator().manual_seed(1))
    features = drafter.context_features(tapped.reshape(80, -1)).view(2, 40, -1)
    starts = torch.tensor([40, 40])
    context = drafter.context_kv(starts, features, torch.ones(2, 40, dtype=torch.bool))
    want = drafter.block_logits(ids[:, -1], starts, context)
    drafter.set_variants({"draft_attention": "triton"})
    got = drafter.block_logits(ids[:, -1], starts, context)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["beam-mini", "beam-501b-tp8"])
def test_every_config_on_the_gpu_at_a_draft_step(preset):
    wl = Workload(preset, batch=1, tokens_per_seq=16, context=4096 + 16)
    assert_every_config_passes(available("draft_attention", "triton"), [wl, wl.with_(batch=8)], seeds=(0,),
                               device="cuda")


@needs_cuda
@pytest.mark.gpu
def test_a_graph_replay_reads_the_new_contents():
    v = available("draft_attention", "triton")
    wl = Workload("beam-mini", batch=1, tokens_per_seq=16, context=4096 + 16)
    args = spec("draft_attention").inputs(wl, "cuda", 0).args
    fn = v.at(v.configs[1])
    fn(*args)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    fresh = spec("draft_attention").inputs(wl, "cuda", 1).args
    for old, new in zip(args, fresh):
        old.copy_(new)
    graph.replay()
    torch.testing.assert_close(out, v.at(v.configs[1])(*fresh), rtol=0, atol=0)
