"""Weights: seeded random init, safetensors round trips (single file and shards), and corrupt
checkpoints rejected with messages that name the offending tensor or file."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from beam_model.config import BeamConfig
from beam_model.kv_cache import PagedKVCache
from beam_model.model import BeamForCausalLM
from beam_model.weights import INDEX_FILE, SINGLE_FILE, CheckpointError, checkpoint_tensors, save_checkpoint

TINY = BeamConfig.from_preset("beam-tiny")


@pytest.fixture(scope="module")
def model():
    return BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32, seed=0)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, TINY.vocab_size, (40,), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def saved(model, tmp_path):
    path = str(tmp_path / "ckpt")
    model.save_pretrained(path)
    return path


def assert_same_weights(a, b):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert pa[name].dtype == pb[name].dtype, name
        assert torch.equal(pa[name], pb[name]), name


def load(path, dtype=torch.float32):
    return BeamForCausalLM.from_pretrained(path, dtype=dtype)


# ------------------------------------------------------------------ checkpoint names

def test_checkpoint_tensor_names(model):
    names = set(checkpoint_tensors(model))
    c = TINY
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        expected |= {p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                     "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight",
                                     "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                     "self_attn.o_proj.weight", "self_attn.gate_proj.weight", "self_attn.gate_bias",
                                     "self_attn.q_norm.weight", "self_attn.k_norm.weight")}
        if c.is_moe_layer(i):
            expected |= {p + "mlp.gate.weight", p + "mlp.gate.e_score_correction_bias"}
            expected |= {f"{p}mlp.experts.{e}.{m}.weight" for e in range(c.n_routed_experts)
                         for m in ("gate_proj", "up_proj", "down_proj")}
        else:
            expected |= {p + f"mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")}
    assert names == expected
    t = checkpoint_tensors(model)
    h, q, kv = c.hidden_size, c.q_width, c.kv_width
    assert tuple(t["model.layers.0.self_attn.q_proj.weight"].shape) == (q, h)
    assert tuple(t["model.layers.0.self_attn.k_proj.weight"].shape) == (kv, h)
    assert tuple(t["model.layers.0.self_attn.o_proj.weight"].shape) == (h, q)
    assert tuple(t["model.layers.0.self_attn.gate_proj.weight"].shape) == (q, h)
    assert tuple(t["model.layers.0.self_attn.gate_bias"].shape) == (c.num_attention_heads,)
    assert tuple(t["model.layers.0.self_attn.q_norm.weight"].shape) == (c.head_dim,)
    assert tuple(t["model.layers.0.mlp.gate_proj.weight"].shape) == (c.intermediate_size, h)
    assert tuple(t["model.layers.3.mlp.gate.weight"].shape) == (c.n_routed_experts, h)
    assert tuple(t["model.layers.3.mlp.experts.7.gate_proj.weight"].shape) == (c.moe_intermediate_size, h)
    assert tuple(t["model.layers.3.mlp.experts.7.down_proj.weight"].shape) == (h, c.moe_intermediate_size)
    assert tuple(t["lm_head.weight"].shape) == (c.vocab_size, h)
    # stacked experts map one to one onto the per-expert names
    assert torch.equal(t["model.layers.3.mlp.experts.7.up_proj.weight"], model.model.layers[3].mlp.experts.up_proj[7])


def test_router_stays_fp32_in_a_bf16_model():
    m = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.bfloat16)
    for name, p in m.named_parameters():
        if ".mlp.gate." in name:
            assert p.dtype == torch.float32, name
        else:
            assert p.dtype == torch.bfloat16, name


# ------------------------------------------------------------------ round trips

def test_round_trip_single_file(model, saved, ids):
    files = sorted(os.listdir(saved))
    assert files == ["config.json", SINGLE_FILE]
    back = load(saved)
    assert back.config == model.config
    assert_same_weights(model, back)
    assert torch.equal(back(ids), model(ids))


def test_round_trip_bf16(tmp_path, ids):
    m = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.bfloat16, seed=3)
    m.save_pretrained(str(tmp_path))
    with safe_open(str(tmp_path / SINGLE_FILE), framework="pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.bfloat16
        assert f.get_tensor("model.layers.3.mlp.gate.weight").dtype == torch.float32
        assert f.get_tensor("model.layers.3.mlp.gate.e_score_correction_bias").dtype == torch.float32
    back = load(str(tmp_path), dtype=torch.bfloat16)
    assert_same_weights(m, back)
    assert torch.equal(back(ids), m(ids))


def test_round_trip_sharded(model, tmp_path, ids):
    path = str(tmp_path)
    save_checkpoint(model, path, max_shard_bytes=256 * 1024)
    shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    assert len(shards) >= 3 and SINGLE_FILE not in shards
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.load(open(os.path.join(path, INDEX_FILE)))
    tensors = checkpoint_tensors(model)
    assert set(index["weight_map"]) == set(tensors)
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for shard in shards:  # every shard holds exactly what the index says
        with safe_open(os.path.join(path, shard), framework="pt") as f:
            assert set(f.keys()) == {n for n, s in index["weight_map"].items() if s == shard}
    back = load(path)
    assert_same_weights(model, back)
    assert torch.equal(back(ids), model(ids))


def test_saving_over_a_checkpoint_leaves_none_of_its_weight_files(model, tmp_path, ids):
    """Sharded over single and back: the old index would be read before a new single file, and old shards
    would sit beside new ones; other files in the folder stay."""
    path = str(tmp_path)
    other = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32, seed=1)
    (tmp_path / "notes.txt").write_text("kept")
    (tmp_path / "part-00007.safetensors").write_bytes(b"")  # what a write that crashed leaves
    save_checkpoint(other, path, max_shard_bytes=64 * 1024)
    many = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    save_checkpoint(model, path, max_shard_bytes=256 * 1024)
    fewer = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    assert len(fewer) < len(many) and set(json.load(open(os.path.join(path, INDEX_FILE)))["weight_map"].values()) \
        == set(fewer)
    assert torch.equal(load(path)(ids), model(ids))
    save_checkpoint(other, path)
    assert sorted(os.listdir(path)) == ["config.json", SINGLE_FILE, "notes.txt"]
    assert torch.equal(load(path)(ids), other(ids))


# ------------------------------------------------------------------ corrupt checkpoints

def _rewrite(path, change):
    file = os.path.join(path, SINGLE_FILE)
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_tensor(saved):
    name = "model.layers.4.mlp.experts.11.down_proj.weight"
    _rewrite(saved, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"missing tensors: .*" + name.replace(".", r"\.")):
        load(saved)


def test_extra_tensor(saved):
    name = "model.layers.2.mlp.shared_experts.gate_proj.weight"
    _rewrite(saved, lambda t: t.__setitem__(name, torch.zeros(2, 2)))
    with pytest.raises(CheckpointError, match=r"unexpected tensors: .*" + name.replace(".", r"\.")):
        load(saved)


def test_misshaped_tensor(saved):
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite(saved, lambda t: t.__setitem__(name, torch.zeros(TINY.kv_width + 1, TINY.hidden_size)))
    with pytest.raises(CheckpointError) as e:
        load(saved)
    msg = str(e.value)
    assert name in msg and f"[{TINY.kv_width + 1}, {TINY.hidden_size}]" in msg
    assert f"[{TINY.kv_width}, {TINY.hidden_size}]" in msg


def test_misshaped_expert_and_router(saved):
    names = ["model.layers.5.mlp.experts.0.gate_proj.weight", "model.layers.6.mlp.gate.e_score_correction_bias"]

    def change(t):
        t[names[0]] = t[names[0]].t().contiguous()
        t[names[1]] = torch.zeros(TINY.n_routed_experts + 1)
    _rewrite(saved, change)
    with pytest.raises(CheckpointError) as e:
        load(saved)
    for n in names:
        assert n in str(e.value)


def test_every_problem_is_named(saved):
    missing, extra, shaped = "model.norm.weight", "model.layers.0.bogus", "lm_head.weight"

    def change(t):
        t.pop(missing)
        t[extra] = torch.zeros(1)
        t[shaped] = torch.zeros(3, 3)
    _rewrite(saved, change)
    with pytest.raises(CheckpointError) as e:
        load(saved)
    for n in (missing, extra, shaped):
        assert n in str(e.value)


def test_shard_listed_but_absent(model, tmp_path):
    path = str(tmp_path)
    save_checkpoint(model, path, max_shard_bytes=256 * 1024)
    index = json.load(open(os.path.join(path, INDEX_FILE)))
    gone = sorted(set(index["weight_map"].values()))[1]
    os.remove(os.path.join(path, gone))
    with pytest.raises(CheckpointError, match=gone):
        load(path)


def test_tensor_listed_in_index_but_absent_from_its_shard(model, tmp_path):
    path = str(tmp_path)
    save_checkpoint(model, path, max_shard_bytes=256 * 1024)
    index = json.load(open(os.path.join(path, INDEX_FILE)))
    name = "model.layers.3.self_attn.v_proj.weight"
    shard = os.path.join(path, index["weight_map"][name])
    tensors = load_file(shard)
    tensors.pop(name)
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load(path)


def test_bad_index(model, tmp_path):
    path = str(tmp_path)
    save_checkpoint(model, path, max_shard_bytes=256 * 1024)
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        f.write("{not json")
    with pytest.raises(CheckpointError, match=INDEX_FILE):
        load(path)


def test_no_weights_file(tmp_path):
    TINY.save_pretrained(str(tmp_path))
    with pytest.raises(CheckpointError, match=SINGLE_FILE):
        load(str(tmp_path))


def test_missing_config_json(saved):
    os.remove(os.path.join(saved, "config.json"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load(saved)


def test_config_mismatch_names_tensors(saved):
    """A config.json that disagrees with the weights (wider FFN) names the mis-shaped tensors."""
    cfg = json.load(open(os.path.join(saved, "config.json")))
    cfg["intermediate_size"] = 2 * TINY.intermediate_size
    json.dump(cfg, open(os.path.join(saved, "config.json"), "w"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight"):
        load(saved)


# ------------------------------------------------------------------ random init

def test_same_seed_same_weights():
    a = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32, seed=5)
    b = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32, seed=5)
    assert_same_weights(a, b)


def test_different_seed_different_weights():
    a = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32, seed=5)
    b = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32, seed=6)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    for name in pa:
        assert not torch.equal(pa[name], pb[name]), name


def test_tensors_are_independent_draws(model):
    """Each tensor has its own stream: no two same-shaped tensors are equal."""
    t = checkpoint_tensors(model)
    a, b = t["model.layers.0.self_attn.q_proj.weight"], t["model.layers.1.self_attn.q_proj.weight"]
    assert not torch.equal(a, b)
    assert not torch.equal(t["model.layers.3.mlp.experts.0.gate_proj.weight"],
                           t["model.layers.3.mlp.experts.1.gate_proj.weight"])


def test_init_statistics(model):
    t = checkpoint_tensors(model)
    h = TINY.hidden_size
    norm = t["model.layers.2.input_layernorm.weight"]
    assert abs(norm.mean().item() - 1) < 0.1
    q = t["model.layers.2.self_attn.q_proj.weight"]
    assert q.std().item() == pytest.approx(h ** -0.5, rel=0.1)
    down = t["model.layers.0.mlp.down_proj.weight"]
    assert down.std().item() == pytest.approx(TINY.intermediate_size ** -0.5, rel=0.1)
    assert t["model.embed_tokens.weight"].std().item() == pytest.approx(1.0, rel=0.05)
    assert t["model.layers.3.mlp.gate.weight"].dtype == torch.float32


def test_init_keeps_activations_order_one(model, ids):
    """Hidden-state RMS after every sub-layer (each boundary) stays O(1); logits are finite, of
    std ~10, and inside the soft-cap."""
    records = []
    boundary = model.ops.boundary

    def recording(y, h, w, **kw):
        h_new, x = boundary(y, h, w, **kw)
        records.append((len(records) + 1, y.float().pow(2).mean().sqrt().item(),
                        h_new.float().pow(2).mean().sqrt().item()))
        return h_new, x

    model.ops.boundary = recording
    try:
        logits = model(torch.stack([ids, ids.flip(0)]))
    finally:
        model.ops.boundary = boundary
    assert [r[0] for r in records] == list(range(1, 2 * TINY.num_hidden_layers + 1))
    emb_rms = model.embed(ids).float().pow(2).mean().sqrt().item()
    assert 0.5 < emb_rms < 2
    for k, y_rms, h_rms in records:
        assert 0.3 < h_rms < 3, (k, h_rms)
        assert 0.01 < y_rms < 100, (k, y_rms)  # sub-layer outputs are finite, not degenerate
    assert torch.isfinite(logits).all()
    assert (logits.abs() < TINY.final_logit_softcapping).all()
    assert 4 < logits.std().item() < 20
    # not collapsed: different positions give different distributions
    assert logits[0].argmax(-1).unique().numel() > 5


def test_hidden_state_rms_bf16(ids):
    m = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.bfloat16, seed=0)
    cache = PagedKVCache.for_sequences(m.config, [len(ids)], dtype=torch.bfloat16)
    cache.add(0)
    step = cache.prepare_step([0], [len(ids)])
    with torch.inference_mode():
        h = m.hidden_states(ids, cache, step)
        logits = m.logits(h)
    assert h.dtype == torch.bfloat16 and logits.dtype == torch.float32
    assert 0.3 < h.float().pow(2).mean().sqrt().item() < 3
    assert torch.isfinite(logits).all() and (logits.abs() <= 30).all()
