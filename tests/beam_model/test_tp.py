"""Tensor and expert parallelism: shard_config shapes, and 2 or 4 gloo ranks on the CPU against the unsharded
model."""

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from beam_model.config import BeamConfig
from beam_model.kv_cache import PagedKVCache
from beam_model.model import BeamForCausalLM
from beam_model.tp import load_shard, shard_config, shard_model, split_dim

WORLD = 2
PROMPT_LENS = [13, 21]  # ragged batch; both cross the sliding window (16) during decode
DECODE_STEPS = 4
FORWARD_SHAPE = (2, 150)  # 300 tokens: the grouped-experts prefill path


def _inputs():
    g = torch.Generator().manual_seed(1234)
    vocab = BeamConfig.from_preset("beam-tiny").vocab_size
    forward_ids = torch.randint(0, vocab, FORWARD_SHAPE, generator=g)
    prompts = [torch.randint(0, vocab, (n,), generator=g) for n in PROMPT_LENS]
    decode_ids = torch.randint(0, vocab, (DECODE_STEPS, len(PROMPT_LENS)), generator=g)
    return forward_ids, prompts, decode_ids


def _full_model(weights="bf16"):
    return BeamForCausalLM.from_preset("beam-tiny", seed=0, dtype=torch.float32, weights=weights)


@torch.inference_mode()
def _prefill_decode(model, prompts, decode_ids):
    """Batched prefill of ragged prompts then batched decode steps; logits [1 + steps, B, vocab]."""
    seqs = list(range(len(prompts)))
    cache = PagedKVCache.for_sequences(model.config, [len(p) + len(decode_ids) for p in prompts],
                                       dtype=model.dtype, device=model.device)
    for s in seqs:
        cache.add(s)
    step = cache.prepare_step(seqs, [len(p) for p in prompts])
    out = [model.step(torch.cat(prompts), cache, step)]
    for ids in decode_ids:
        step = cache.prepare_step(seqs, [1] * len(seqs))
        out.append(model.step(ids, cache, step))
    return torch.stack(out)


def _worker(rank, world, init_file, out_dir, ckpt, expert_parallel=False, weights="bf16"):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        forward_ids, prompts, decode_ids = _inputs()
        full = _full_model(weights)
        model = shard_model(full, rank, world, dist.group.WORLD, expert_parallel=expert_parallel)
        del full
        loaded = load_shard(ckpt, rank, world, dist.group.WORLD, dtype=torch.float32, expert_parallel=expert_parallel)
        ours, theirs = dict(model.named_parameters()), dict(loaded.named_parameters())
        result = {
            "forward": model(forward_ids),
            "decode": _prefill_decode(model, prompts, decode_ids),
            "load_shard_mismatch": sorted(n for n in ours if not torch.equal(ours[n], theirs[n])),
            "shapes": {n: tuple(p.shape) for n, p in ours.items()},
        }
        torch.save(result, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _run_ranks(tmp_path, expert_parallel, weights="bf16", world=WORLD):
    """Each rank's results (forward, prefill + decode logits, parameter shapes), and the full model."""
    full = _full_model(weights)
    ckpt = tmp_path / "ckpt"
    full.save_pretrained(str(ckpt))
    mp.spawn(_worker, args=(world, str(tmp_path / "rendezvous"), str(tmp_path), str(ckpt), expert_parallel, weights),
             nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)], full


def _check_against_full(results, full):

    forward_ids, prompts, decode_ids = _inputs()
    ref_forward = full(forward_ids)
    ref_decode = _prefill_decode(full, prompts, decode_ids)
    for r, res in enumerate(results):
        assert res["forward"].shape == ref_forward.shape
        assert res["decode"].shape == ref_decode.shape
        assert _rel_err(res["forward"], ref_forward) < 1e-4, f"rank {r} forward"
        assert _rel_err(res["decode"], ref_decode) < 1e-4, f"rank {r} prefill+decode"
        for s in range(len(ref_decode)):  # every step on its own, not only on aggregate
            assert _rel_err(res["decode"][s], ref_decode[s]) < 1e-4, f"rank {r} step {s}"
        assert res["load_shard_mismatch"] == [], f"rank {r}: load_shard differs from shard_model"
    # the gathered logits are the same bits on every rank
    for res in results[1:]:
        assert torch.equal(results[0]["forward"], res["forward"])
        assert torch.equal(results[0]["decode"], res["decode"])


def test_two_ranks_match_unsharded(tmp_path):
    results, full = _run_ranks(tmp_path, expert_parallel=False)
    _check_against_full(results, full)
    # one rank's shapes: attention heads split by 2, router replicated, vocab halved
    shapes = results[0]["shapes"]
    c = full.config
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (c.q_width // 2, c.hidden_size)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (c.kv_width // 2, c.hidden_size)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (c.hidden_size, c.q_width // 2)
    assert shapes["model.layers.6.mlp.experts.down_proj"] == (c.n_routed_experts, c.hidden_size,
                                                             c.moe_intermediate_size // 2)
    assert shapes["model.layers.6.mlp.gate.weight"] == (c.n_routed_experts, c.hidden_size)
    assert shapes["lm_head.weight"] == (c.vocab_size // 2, c.hidden_size)


def test_two_expert_parallel_ranks_match_unsharded(tmp_path):
    """Each rank holds half the experts whole; attention, dense layers, embedding and head stay split."""
    results, full = _run_ranks(tmp_path, expert_parallel=True)
    _check_against_full(results, full)
    shapes, c = results[0]["shapes"], full.config
    assert shapes["model.layers.6.mlp.experts.down_proj"] == (c.n_routed_experts // 2, c.hidden_size,
                                                             c.moe_intermediate_size)
    assert shapes["model.layers.6.mlp.gate.weight"] == (c.n_routed_experts, c.hidden_size)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (c.q_width // 2, c.hidden_size)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (c.hidden_size, c.intermediate_size // 2)


def test_four_ranks_share_the_kv_heads_and_match_unsharded(tmp_path):
    """beam-tiny has 2 kv heads: over 4 ranks each holds the one its query head reads (ranks 0 and 1 kv
    head 0, ranks 2 and 3 kv head 1), sharded from the model and loaded from its checkpoint alike."""
    results, full = _run_ranks(tmp_path, expert_parallel=False, world=4)
    _check_against_full(results, full)
    c = full.config
    assert results[0]["shapes"]["model.layers.0.self_attn.k_proj.weight"] == (c.head_dim, c.hidden_size)
    assert results[0]["shapes"]["model.layers.0.self_attn.q_proj.weight"] == (c.q_width // 4, c.hidden_size)


@pytest.mark.parametrize("weights,expert_parallel", [("bf16", True), ("fp8", False)])
def test_four_ranks_match_unsharded(tmp_path, weights, expert_parallel):
    """Four expert-parallel ranks (4 whole experts each, top_k of them), and four FP8 ranks, whose kv
    projections' row scales are shared with their rows."""
    results, full = _run_ranks(tmp_path, expert_parallel, weights, world=4)
    _check_against_full(results, full)
    c = full.config
    if weights == "fp8":
        assert results[3]["shapes"]["model.layers.0.self_attn.v_proj.weight_scale"] == (c.head_dim, 1)
    else:
        assert results[3]["shapes"]["model.layers.6.mlp.experts.down_proj"] == (c.n_routed_experts // 4,
                                                                                c.hidden_size, c.moe_intermediate_size)


MINI = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "models",
                    "beam-mini")


def _mini_worker(rank, world, init_file, out_dir, ids):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = load_shard(MINI, rank, world, dist.group.WORLD, dtype=torch.float32)
        with torch.inference_mode():
            torch.save(model(ids), f"{out_dir}/mini{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not os.path.isfile(os.path.join(MINI, "model.safetensors")), reason="no committed beam-mini")
@pytest.mark.parametrize("world", [2, 4])
def test_the_trained_beam_mini_loaded_on_ranks_matches_one_process(tmp_path, world):
    """The committed beam-mini checkpoint, each rank reading its slices (two ranks to a kv head at 4), gives
    the single process's logits."""
    full = BeamForCausalLM.from_pretrained(MINI, dtype=torch.float32)
    ids = torch.randint(0, full.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    mp.spawn(_mini_worker, args=(world, str(tmp_path / "rendezvous"), str(tmp_path), ids), nprocs=world, join=True)
    with torch.inference_mode():
        expected = full(ids)
    for r in range(world):
        assert _rel_err(torch.load(tmp_path / f"mini{r}.pt"), expected) < 1e-4, f"rank {r}"


def test_the_ranks_of_a_kv_heads_query_group_hold_that_kv_head():
    from beam_model.tp import kv_block, shard_tensor

    name = "model.layers.0.self_attn.k_proj.weight"
    assert [kv_block(name, r, 8, 2) for r in range(8)] == [(0, 2)] * 4 + [(1, 2)] * 4
    assert [kv_block(name, r, 2, 2) for r in range(2)] == [(0, 2), (1, 2)]
    assert kv_block("model.layers.0.self_attn.q_proj.weight", 5, 8, 2) == (5, 8)
    rows = torch.arange(6.0)[:, None]  # 2 kv heads of 3 rows
    assert [shard_tensor(name, rows, r, 4, 2).flatten().tolist() for r in range(4)] == \
        [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]]


def test_local_experts_keep_only_the_ranks_pairs():
    from beam_model.tp import TensorParallel

    ids = torch.tensor([[0, 5, 8], [9, 14, 3], [7, 8, 1]])
    weights = torch.tensor([[0.5, 1.5, 1.0], [1.0, 2.0, 3.0], [0.25, 0.75, 1.0]])
    local_ids, local_w = TensorParallel(None, 0, 1, experts=(8, 8)).local_experts(ids, weights)
    # another rank's pairs weigh 0 and take the lowest local ids their token leaves free: ids stay distinct
    assert local_ids.tolist() == [[1, 2, 0], [1, 6, 0], [1, 0, 2]]
    assert local_w.tolist() == [[0.0, 0.0, 1.0], [1.0, 2.0, 0.0], [0.0, 0.75, 0.0]]
    assert TensorParallel(None, 0, 1).local_experts(ids, weights) == (ids, weights)


def test_expert_parallelism_needs_the_experts_to_divide():
    c = BeamConfig.from_preset("beam-tiny")
    with pytest.raises(ValueError, match=f"n_routed_experts={c.n_routed_experts} not divisible by 3"):
        shard_config(dataclasses.replace(c, num_attention_heads=6, num_key_value_heads=3, intermediate_size=96,
                                         vocab_size=288 * 3), 3, expert_parallel=True)
    assert shard_config(c, 2, expert_parallel=True).moe_intermediate_size == c.moe_intermediate_size


def test_world_of_one_is_the_full_model():
    full = _full_model()
    model = shard_model(full, 0, 1, None)
    ids = torch.arange(40) % full.config.vocab_size
    assert torch.equal(model(ids), full(ids))
    assert model.ops.selection == full.ops.selection


def test_shard_config_matches_tp8_preset():
    sharded = shard_config(BeamConfig.from_preset("beam-501b"), 8)
    preset = BeamConfig.from_preset("beam-501b-tp8")
    a, b = dataclasses.asdict(sharded), dataclasses.asdict(preset)
    differing = {k: (a[k], b[k]) for k in a if k != "preset" and a[k] != b[k]}
    assert differing == {}
    assert sharded.config_hash() == preset.config_hash()
    assert sharded.preset == "beam-501b-tp8"


def test_shard_config_rejects_non_divisible_world():
    tiny = BeamConfig.from_preset("beam-tiny")  # 4 heads, 2 kv heads, vocab 288
    with pytest.raises(ValueError, match="num_attention_heads=4.*not divisible by 3"):
        shard_config(tiny, 3)
    with pytest.raises(ValueError, match="num_key_value_heads=3 neither divisible by 2 nor dividing it"):
        shard_config(dataclasses.replace(tiny, num_attention_heads=6, num_key_value_heads=3), 2)
    assert shard_config(tiny, 4).num_key_value_heads == 1  # two ranks a kv head
    with pytest.raises(ValueError, match="positive integer"):
        shard_config(tiny, 0)
    assert shard_config(tiny, 1).config_hash() == tiny.config_hash()


def test_every_parameter_has_a_rule():
    model = BeamForCausalLM(BeamConfig.from_preset("beam-tiny"))  # meta device: names only
    for name, _ in model.named_parameters():
        split_dim(name)
    with pytest.raises(KeyError):
        split_dim("model.layers.0.self_attn.new_thing")


@pytest.mark.parametrize("weights,expert_parallel", [("fp8", False), ("nvfp4", False), ("nvfp4", True)])
def test_quantized_ranks_match_unsharded(tmp_path, weights, expert_parallel):
    """A quantized model's ranks, sharded from the model and loaded from its checkpoint (each rank reading
    its own slices of the codes and scales), against the unsharded quantized model."""
    results, full = _run_ranks(tmp_path, expert_parallel, weights)
    _check_against_full(results, full)
    shapes, c = results[0]["shapes"], full.config
    experts = c.n_routed_experts // 2 if expert_parallel else c.n_routed_experts
    if weights == "fp8":  # one scale per output row: split with the rows, whole on a row-parallel rank
        assert shapes["model.layers.0.self_attn.q_proj.weight_scale"] == (c.q_width // 2, 1)
        assert shapes["model.layers.0.self_attn.o_proj.weight_scale"] == (c.hidden_size, 1)
        assert shapes["model.layers.6.mlp.experts.down_proj_scale"] == (experts, c.hidden_size, 1)
    else:  # two codes a byte, a scale per 16 inputs, one global scale per expert
        ff = c.moe_intermediate_size if expert_parallel else c.moe_intermediate_size // 2
        assert shapes["model.layers.6.mlp.experts.down_proj"] == (experts, c.hidden_size, ff // 2)
        assert shapes["model.layers.6.mlp.experts.down_proj_scale"] == (experts, c.hidden_size, ff // 16)
        assert shapes["model.layers.6.mlp.experts.down_proj_scale_2"] == (experts,)
        assert shapes["model.layers.0.self_attn.q_proj.weight"] == (c.q_width // 2, c.hidden_size)  # not quantized


def test_a_quantized_slice_its_format_cannot_store_is_refused():
    from beam_model.quant.scheme import QuantScheme
    from beam_model.tp import check_shardable

    config = dataclasses.replace(BeamConfig.from_preset("beam-tiny"), moe_intermediate_size=48)
    nvfp4 = QuantScheme.for_format("nvfp4")
    with pytest.raises(ValueError, match="nvfp4 model does not shard over 2 ranks.*multiple of 16, got 24"):
        check_shardable(config, 2, quant=nvfp4)  # each rank's down projection reads 24 inputs
    check_shardable(config, 2, expert_parallel=True, quant=nvfp4)  # whole experts: 48 inputs
    check_shardable(config, 2, quant=QuantScheme.for_format("fp8"))  # FP8 scales rows, not input blocks


def test_a_world_of_one_runs_no_collective(monkeypatch):
    """The one rank of a group of one holds the whole sum: its boundaries skip the all-reduce as its embedding and
    logits skip theirs, so the step equals the step without a group (an NCCL all-reduce over one rank is a copy
    and a launch per boundary)."""
    from beam_model.tp import TensorParallel

    group = object()  # any group: a world of one never calls into torch.distributed
    assert TensorParallel(group, 0, 1).reduce_group is None
    _, prompts, decode_ids = _inputs()
    model = _full_model()
    alone = _prefill_decode(model, prompts, decode_ids)

    def collective(*args, **kwargs):
        raise AssertionError("a collective ran in a world of one")

    for name in ("all_reduce", "all_gather"):
        monkeypatch.setattr(dist, name, collective)
    model.tp = TensorParallel(group, 0, 1)
    torch.testing.assert_close(_prefill_decode(model, prompts, decode_ids), alone, rtol=0, atol=0)
