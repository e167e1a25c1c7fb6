"""The DFlash drafter's config and checkpoint: the layers it reads, a round trip through safetensors, and
refusals that name the problem (a missing tensor, another target, a config that is not a drafter's);
and `workbench train-drafter`'s training step on beam-tiny."""

import dataclasses
import json

import pytest
import torch

from beam_model.drafter import BeamDrafter
from beam_model.drafter_config import DrafterConfig, proportional_taps
from beam_model.model import BeamForCausalLM
from beam_model.weights import CheckpointError
from workbench.training.drafter import DrafterOptions, DrafterTrainer, converted, initial_drafter


@pytest.fixture(scope="module")
def target():
    return BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32)


def test_taps_sit_at_beams_relative_depths():
    assert proportional_taps(52) == [1, 13, 25, 37, 49]
    assert proportional_taps(8) == [0, 2, 4, 6, 7]
    assert proportional_taps(2) == [0, 1]
    with pytest.raises(ValueError, match="increasing order"):
        DrafterConfig(target_layer_ids=[3, 1], target_config_hash="x", vocab_size=8, hidden_size=8)


def test_a_drafter_round_trips_and_proposes_the_same_logits(target, tmp_path):
    drafter = initial_drafter(DrafterConfig.for_target(target.config, num_hidden_layers=1, block_size=4), target,
                              seed=0, device="cpu")
    drafter.save_pretrained(str(tmp_path))
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "model.safetensors"))
    assert "fc.weight" in saved and not [n for n in saved if n.startswith("target")]  # the target's are not its
    again = BeamDrafter.from_pretrained(str(tmp_path), target)
    c = drafter.config
    context = torch.randn(2, c.sliding_window, c.hidden_size)
    valid = torch.ones(2, c.sliding_window, dtype=torch.bool)
    valid[1, :5] = False
    first, starts = torch.tensor([3, 7]), torch.tensor([c.sliding_window, 11])
    with torch.no_grad():
        logits = drafter.block_logits(first, starts, drafter.context_kv(starts, context, valid))
        assert torch.equal(logits, again.block_logits(first, starts, again.context_kv(starts, context, valid)))
        assert logits.shape == (2, 3, target.config.vocab_size)


def _plain_attention(drafter, starts, context, layer, x, _features, _store, _written_at, _keys_at, mask):
    """A draft layer's block attention written out in plain PyTorch (FP32): the context's keys and
    values from its features, the block's from its rows, head norms and RoPE at each position (the
    context's before `starts`, the block's from it), every block row attending to the valid context and
    the whole block."""
    from beam_model.functional import apply_rope, linear, rms_norm, rope_cos_sin

    c, a = drafter.config, layer.self_attn
    heads, kv_heads, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    s, c_len = context.shape[:2]
    b = x.shape[0] // s
    ctx = context.reshape(s * c_len, -1)
    ctx_pos = (starts[:, None] - c_len + torch.arange(c_len)).clamp(min=0).reshape(-1)
    block_pos = (starts[:, None] + torch.arange(b)).reshape(-1)

    def normed(t, norm, pos):
        heads_of_t = rms_norm(t.view(len(pos), -1, d), norm.weight, c.rms_norm_eps)
        return apply_rope(heads_of_t, *rope_cos_sin(pos, d, c.rope_theta))

    q = normed(linear(x, a.q_proj.weight), a.q_norm, block_pos).view(s, b, heads, d)
    k = torch.cat([normed(linear(ctx, a.k_proj.weight), a.k_norm, ctx_pos).view(s, -1, kv_heads, d),
                   normed(linear(x, a.k_proj.weight), a.k_norm, block_pos).view(s, b, kv_heads, d)], 1)
    v = torch.cat([linear(ctx, a.v_proj.weight).view(s, -1, kv_heads, d),
                   linear(x, a.v_proj.weight).view(s, b, kv_heads, d)], 1)
    k, v = (t.repeat_interleave(heads // kv_heads, 2) for t in (k, v))
    scores = torch.einsum("sqhd,skhd->shqk", q, k) / d ** 0.5
    weights = (scores + mask[:, None, None, :]).softmax(-1)  # -inf where a key does not exist
    out = torch.einsum("shqk,skhd->sqhd", weights, v).reshape(s * b, heads, d)
    return drafter.ops.attn_out(out, linear(x, a.gate_proj.weight), layer.prepared["attn_out"])


def test_the_block_attention_through_the_fusion_points_is_the_plain_one(target, monkeypatch):
    drafter = initial_drafter(DrafterConfig.for_target(target.config, num_hidden_layers=2, block_size=4), target,
                              seed=0, device="cpu")
    c = drafter.config
    gen = torch.Generator().manual_seed(0)
    context = torch.randn(2, c.sliding_window, c.hidden_size, generator=gen)
    valid = torch.ones(2, c.sliding_window, dtype=torch.bool)
    valid[1, :c.sliding_window - 11] = False  # the second sequence is 11 tokens long
    first, starts = torch.tensor([3, 7]), torch.tensor([c.sliding_window + 5, 11])
    with torch.no_grad():
        through_points = drafter.block_logits(first, starts, drafter.context_kv(starts, context, valid))
        monkeypatch.setattr(drafter, "_attention", lambda *a: _plain_attention(drafter, starts, context, *a))
        plain = drafter.block_logits(first, starts, drafter.context_kv(starts, context, valid))
    torch.testing.assert_close(through_points, plain, rtol=1e-5, atol=1e-5)


def test_a_block_reads_through_page_tables_what_it_reads_from_features(target):
    """The engine's drafter: each position's keys written once to pages the sequence's table names (out
    of order, some released), then read by blocks at two positions; the same as the block over the
    window's features (`context_kv`)."""
    from beam_model.drafter import ContextKV

    drafter = initial_drafter(DrafterConfig.for_target(target.config, num_hidden_layers=2, block_size=4), target,
                              seed=0, device="cpu")
    c, ps = drafter.config, 8
    gen = torch.Generator().manual_seed(0)
    length = c.sliding_window + 20
    features = torch.randn(length, c.hidden_size, generator=gen)
    n_pages = -(-length // ps)
    table = torch.randperm(n_pages, generator=gen) + 3  # pages 0..2 are not the sequence's; 0 takes the block's
    store = drafter.context_store(n_pages + 3, ps)
    positions = torch.arange(length)
    with torch.no_grad():
        drafter.write_context(features, positions, table[positions // ps] * ps + positions % ps, store)
        for p in (9, length):  # a sequence shorter than the window; a full window
            held = table.clone()
            held[:max(0, p - c.sliding_window) // ps] = -1  # released: before the window
            starts = torch.tensor([p])
            context = ContextKV.from_page_table(store, held[None], starts, c.sliding_window, torch.tensor([0]))
            paged = drafter.block_logits(torch.tensor([5]), starts, context)
            window = torch.zeros(1, c.sliding_window, c.hidden_size)
            valid = torch.zeros(1, c.sliding_window, dtype=torch.bool)
            m = min(p, c.sliding_window)
            window[0, c.sliding_window - m:], valid[0, c.sliding_window - m:] = features[p - m:p], True
            from_features = drafter.block_logits(torch.tensor([5]), starts, drafter.context_kv(starts, window, valid))
            torch.testing.assert_close(paged, from_features, rtol=1e-5, atol=1e-5)
        # the last 3 positions' keys written by the block's own layers (the engine's verify + draft step)
        for layer in store:
            layer.zero_()
        slots = table[positions // ps] * ps + positions % ps
        drafter.write_context(features[:-3], positions[:-3], slots[:-3], store)
        starts = torch.tensor([length])
        context = ContextKV.from_page_table(store, table[None], starts, c.sliding_window, torch.tensor([0]))
        fed = (features[-3:], positions[-3:], slots[-3:])
        torch.testing.assert_close(drafter.block_logits(torch.tensor([5]), starts, context, fed=fed), paged,
                                   rtol=1e-5, atol=1e-5)


def test_a_context_window_exists_where_its_position_does_and_its_page_is_held():
    from beam_model.drafter import ContextKV

    tables, store, blocks = torch.tensor([[-1, 7, 4], [2, -1, -1]]), [torch.zeros(8, 2, 4, 1, 2)], torch.tensor([0, 1])
    kv = ContextKV.from_page_table(store, tables, torch.tensor([9, 2]), 4, blocks)
    assert kv.pages.tolist() == [[7, 7, 7, 4], [2, 2, 2, 2]]
    assert kv.offsets.tolist() == [[1, 2, 3, 0], [0, 0, 0, 1]]  # positions 5..8; -2..1 (below 0: at 0)
    assert kv.valid.tolist() == [[True, True, True, True], [False, False, True, True]]
    kv = ContextKV.from_page_table(store, tables, torch.tensor([6, 2]), 4, blocks)
    assert kv.valid[0].tolist() == [False, False, True, True]  # positions 2, 3 sit on a released page


def test_a_broken_drafter_checkpoint_is_refused_by_name(target, tmp_path):
    drafter = initial_drafter(DrafterConfig.for_target(target.config, num_hidden_layers=1), target, seed=0,
                              device="cpu")
    drafter.save_pretrained(str(tmp_path))
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensors: layers.0.mlp.up_proj.weight"):
        BeamDrafter.from_pretrained(str(tmp_path), target)
    other = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32, seed=1)  # same shapes: same config
    mini = BeamForCausalLM(DrafterConfig.for_target(target.config).layer_config())  # another architecture
    assert other.config.config_hash() == target.config.config_hash()
    with pytest.raises(ValueError, match="trained for the target with config hash"):
        BeamDrafter.from_pretrained(str(tmp_path), mini)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "beam"}))
    with pytest.raises(ValueError, match="not a DFlash drafter"):
        DrafterConfig.from_pretrained(str(tmp_path))


def test_training_steps_move_the_drafter_towards_the_target(target):
    from workbench.training.data import TokenStream

    ids = torch.arange(4000) % 97  # a periodic stream the target's own next-token choices follow
    stream = TokenStream(ids, torch.ones(target.config.vocab_size, dtype=torch.int64), 1, 4000)
    opts = DrafterOptions(layers=1, block_size=4, steps=6, batch=2, seq_len=48, anchors=4, warmup=1, lr=3e-3)
    trainer = DrafterTrainer(opts, target, stream)
    before = {n: p.detach().clone() for n, p in trainer.drafter.named_parameters()}
    drafter = trainer.run()
    losses = [h[1] for h in trainer.history]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    assert [n for n, p in drafter.named_parameters() if torch.equal(before[n], p)] == []
    assert converted(drafter, torch.bfloat16).fc.weight.dtype == torch.bfloat16


def test_a_bf16_target_trains_its_drafter_under_autocast_with_fp32_weights():
    """The GPU's distillation: the target as served (BF16), the drafter's math under BF16 autocast and
    its master weights FP32 (a BF16 head times FP32 features fails without the autocast)."""
    from workbench.training.data import TokenStream

    target = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.bfloat16)
    stream = TokenStream(torch.arange(4000) % 97, torch.ones(target.config.vocab_size, dtype=torch.int64), 1, 4000)
    opts = DrafterOptions(layers=1, block_size=4, steps=6, batch=2, seq_len=48, anchors=4, warmup=1, lr=3e-3)
    trainer = DrafterTrainer(opts, target, stream)
    assert trainer.autocast == torch.bfloat16
    drafter = trainer.run()
    losses = [h[1] for h in trainer.history]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    assert {p.dtype for p in drafter.parameters()} == {torch.float32}


def test_a_training_stopped_and_resumed_ends_where_one_run_would(target):
    """`state_dict` holds everything a step depends on (weights, AdamW's moments, the data generator), so
    two steps, a new process's trainer loading them, and two more give the weights of four steps in one
    run; a state made with other options is refused, naming them."""
    from workbench.training.data import TokenStream

    stream = TokenStream(torch.arange(4000) % 97, torch.ones(target.config.vocab_size, dtype=torch.int64), 1, 4000)
    opts = DrafterOptions(layers=1, block_size=4, steps=4, batch=2, seq_len=48, anchors=4, warmup=1, lr=3e-3)
    whole = DrafterTrainer(opts, target, stream).run()
    first = DrafterTrainer(opts, target, stream)
    assert first.run(max_seconds=0.0) is None and first.history == []  # out of time before its first step
    first.step(0)
    first.step(1)
    second = DrafterTrainer(opts, target, stream)
    second.load_state_dict(first.state_dict())
    resumed = second.run()
    assert [h[0] for h in second.history] == [1, 2, 3, 4]
    assert all(torch.equal(p, resumed.get_parameter(n)) for n, p in whole.named_parameters())
    other = DrafterTrainer(dataclasses.replace(opts, lr=1e-3), target, stream)
    with pytest.raises(ValueError, match="other options: lr 0.003"):
        other.load_state_dict(first.state_dict())


@pytest.mark.gpu
def test_the_gpu_distillation_target_gives_the_references_outputs():
    """On a GPU the frozen target attends through `attention:triton` (one prefill for every window, not a
    sequence at a time): its tapped states and logits over real windows are the reference's within
    BF16 rounding, and the most likely tokens the drafter learns are the same."""
    import os

    from workbench.training.drafter import frozen_target, target_outputs

    mini = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "models", "beam-mini")
    fast = frozen_target(mini, "cuda")
    assert fast.ops.selection["attention"] == "triton"
    reference = BeamForCausalLM.from_pretrained(mini, dtype=torch.bfloat16, device="cuda")
    windows = torch.randint(0, fast.config.vocab_size, (4, 200), generator=torch.Generator().manual_seed(0)).cuda()
    taps = DrafterConfig.for_target(fast.config).target_layer_ids
    (t_fast, l_fast), (t_ref, l_ref) = (target_outputs(m, windows, taps) for m in (fast, reference))
    for fast_out, ref_out in ((t_fast, t_ref), (l_fast, l_ref)):
        error = (fast_out.float() - ref_out.float()).norm() / ref_out.float().norm()
        assert error < 2e-2, error
    assert (l_fast.argmax(-1) == l_ref.argmax(-1)).float().mean() > 0.95
