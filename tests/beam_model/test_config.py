"""Tests for beam_model.config: the published totals, layer layout, presets and config.json I/O.

The expected figures come from docs/beam-architecture.md ("Totals this must reproduce ... to 0.5%"
and the TP8 section); every assertion derives them from the doc's component figures, never from
the code under test.
"""

import json

import pytest

from beam_model.config import FULL, PRESETS, SLIDING, BeamConfig

M, B = 1e6, 1e9

# The doc's component figures (parameters).
DOC_ATTENTION = 104.9 * M   # per layer
DOC_DENSE = 314.6 * M       # per dense layer
DOC_EXPERT = 39.3 * M       # per expert
DOC_ROUTER = 1.31 * M       # per MoE layer
DOC_EMBED = 671 * M         # embedding, and again the head


def rel(a, b):
    return abs(a - b) / abs(b)


@pytest.fixture(scope="module")
def full():
    return BeamConfig.from_preset("beam-501b")


@pytest.fixture(scope="module")
def tp8():
    return BeamConfig.from_preset("beam-501b-tp8")


@pytest.fixture(scope="module")
def tiny():
    return BeamConfig.from_preset("beam-tiny")


# ------------------------------------------------------------------ full-size totals

def test_default_config_is_the_published_model(full):
    assert full.to_dict() | {"preset": None} == BeamConfig().to_dict()
    assert (full.num_hidden_layers, full.hidden_size, full.vocab_size) == (52, 5120, 131072)
    assert (full.num_attention_heads, full.num_key_value_heads, full.head_dim) == (48, 8, 128)
    assert (full.q_width, full.kv_width) == (6144, 1024)
    assert full.sliding_window == 512
    assert (full.n_routed_experts, full.num_experts_per_tok, full.n_group, full.topk_group) == (256, 8, 8, 4)
    assert full.routed_scaling_factor == 2.5
    assert full.final_logit_softcapping == 30.0
    assert (full.ssmax_base, full.ssmax_exponent) == (2048.0, 0.1)
    assert full.max_position_embeddings == 1048576
    assert full.tie_word_embeddings is False


def test_total_parameters(full):
    assert rel(full.num_parameters, 501.1 * B) < 0.005
    # The doc's breakdown adds up to the same total (it omits only the norms).
    breakdown = 52 * DOC_ATTENTION + 3 * DOC_DENSE + 49 * 256 * DOC_EXPERT + 49 * DOC_ROUTER + 2 * DOC_EMBED
    assert rel(full.num_parameters, breakdown) < 0.005


def test_component_parameter_counts(full):
    assert rel(full._attention_params(), DOC_ATTENTION) < 0.005
    assert rel(3 * full.hidden_size * full.intermediate_size, DOC_DENSE) < 0.005
    assert rel(full._expert_params(), DOC_EXPERT) < 0.005
    assert rel(full._router_params(), DOC_ROUTER) < 0.005
    assert rel(full.vocab_size * full.hidden_size, DOC_EMBED) < 0.005


def test_active_parameters(full):
    # "All parameters except the unselected experts": the doc's breakdown with 8 experts per MoE
    # layer instead of 256, i.e. 501.1B minus 49 x 248 unselected experts.
    derived = 52 * DOC_ATTENTION + 3 * DOC_DENSE + 49 * 8 * DOC_EXPERT + 49 * DOC_ROUTER + 2 * DOC_EMBED
    assert 23.1 * B < derived < 23.3 * B
    assert rel(full.num_active_parameters, derived) < 0.005
    assert round(full.num_active_parameters / B) == 23
    # Same figure computed as "total minus the unselected experts" from the config's own counts.
    unselected = 49 * (256 - 8) * full._expert_params()
    assert full.num_active_parameters == full.num_parameters - unselected


def test_layer_pattern(full):
    assert full.full_attention_layers == [5, 11, 17, 23, 29, 35, 41, 47, 51]
    assert len(full.full_attention_layers) == 9
    assert len(full.sliding_layers) == 43
    assert sorted(full.full_attention_layers + full.sliding_layers) == list(range(52))
    assert full.moe_layers == list(range(3, 52))
    assert [full.is_moe_layer(i) for i in range(3)] == [False] * 3
    assert full.num_residual_adds == 104


def test_kv_bytes_per_token(full):
    assert full.kv_bytes_per_token() == 36 * 1024            # BF16
    assert full.kv_bytes_per_token(dtype_bytes=2) == 9 * 2 * 8 * 128 * 2
    assert full.kv_bytes_per_token(dtype_bytes=1) == 18 * 1024  # FP8
    # SWA layers keep one window each.
    assert full.swa_kv_bytes() == 43 * 2 * 1024 * 2 * 512


# ------------------------------------------------------------------ small presets

def test_tiny_keeps_the_structure(tiny):
    assert tiny.num_hidden_layers == 7
    assert tiny.full_attention_layers == [5, 6]
    assert tiny.sliding_layers == [0, 1, 2, 3, 4]
    assert tiny.layer_types == [SLIDING] * 5 + [FULL] * 2
    assert [i for i in range(7) if not tiny.is_moe_layer(i)] == [0, 1]
    assert tiny.moe_layers == [2, 3, 4, 5, 6]
    assert tiny.n_routed_experts == 16 and tiny.n_group == 4 and tiny.n_routed_experts // tiny.n_group == 4
    assert tiny.topk_group == 2 and tiny.num_experts_per_tok == 4
    assert tiny.sliding_window == 16
    assert tiny.num_attention_heads % tiny.num_key_value_heads == 0
    assert tiny.num_attention_heads > tiny.num_key_value_heads  # GQA kept
    # Unchanged numerics.
    for f in ("rope_theta", "ssmax_base", "ssmax_exponent", "routed_scaling_factor", "rms_norm_eps",
              "final_logit_softcapping", "tie_word_embeddings", "model_type", "arch_version"):
        assert getattr(tiny, f) == getattr(BeamConfig(), f), f


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_keeps_the_full_layer_rule(name):
    c = BeamConfig.from_preset(name)
    n = c.num_hidden_layers
    assert c.full_attention_layers == [i for i in range(n) if i % 6 == 5 or i == n - 1]
    assert c.preset == name
    assert c.n_routed_experts % c.n_group == 0
    assert 0 < c.topk_group < c.n_group  # group-limited routing really drops groups
    assert 0 < c.first_k_dense_replace < n


# ------------------------------------------------------------------ one TP8 rank

def test_tp8_rank_shapes(tp8, full):
    assert tp8.num_attention_heads == 48 // 8 and tp8.num_key_value_heads == 8 // 8
    assert tp8.q_width == 768  # gate width and o_proj input
    assert tp8.intermediate_size == 20480 // 8
    assert tp8.moe_intermediate_size == 2560 // 8
    assert tp8.vocab_size == 131072 // 8
    assert tp8.n_routed_experts == 256 and tp8.hidden_size == full.hidden_size  # router replicated
    assert tp8.layer_types == full.layer_types


def test_tp8_rank_parameters(tp8):
    assert rel(tp8.num_parameters, 62.6 * B) < 0.005
    assert rel(tp8.num_parameters * 2, 125 * B) < 0.01  # ~125 GB in BF16


def test_tp8_half_is_the_rank_cut_to_its_first_26_layers(tp8):
    """The same layers as the rank's first 26 (shapes, kinds, dense then MoE), under 80 GB in BF16."""
    half = BeamConfig.from_preset("beam-501b-tp8-half")
    same = {k: v for k, v in tp8.to_dict().items() if k not in ("num_hidden_layers", "layer_types", "preset")}
    assert {k: v for k, v in half.to_dict().items() if k in same} == same
    assert half.num_hidden_layers == 26 and half.layer_types[:25] == tp8.layer_types[:25]
    assert half.first_k_dense_replace == 3 and half.layer_types[-1] == FULL  # the last layer is full, as ever
    assert 55 * B < half.num_parameters * 2 < 60 * B  # ~59 GB in BF16: 23 of the rank's 49 MoE layers


def test_tp8_decode_step_bytes(tp8):
    """Bytes one decode step reads at batch 1 in BF16 (router FP32): doc says ~5.9 GB."""
    h = tp8.hidden_size
    attention = tp8._attention_params() * 2
    dense = 3 * h * tp8.intermediate_size * 2
    expert = tp8._expert_params() * 2
    router = tp8.n_routed_experts * h * 4
    head = tp8.vocab_size * h * 2
    # Each component against the doc's figure (given to 3 significant digits).
    assert round(attention / M, 1) == 26.2
    assert round(dense / M, 1) == 78.6
    assert round(expert / M, 1) == 9.8
    assert round(router / M, 1) == 5.2
    assert round(head / M) == 168
    n_moe, n_dense = len(tp8.moe_layers), tp8.num_hidden_layers - len(tp8.moe_layers)
    assert (n_moe, n_dense) == (49, 3)
    total = tp8.num_hidden_layers * attention + n_dense * dense \
        + n_moe * (tp8.num_experts_per_tok * expert + router) + head
    assert round(total / B, 1) == 5.9
    assert rel(total, 5.9 * B) < 0.01


# ------------------------------------------------------------------ config.json I/O

@pytest.mark.parametrize("name", ["beam-tiny", "beam-501b-tp8"])
def test_save_load_round_trip(tmp_path, name):
    c = BeamConfig.from_preset(name)
    c.save_pretrained(str(tmp_path))
    d = json.loads((tmp_path / "config.json").read_text())
    assert d["model_type"] == "beam" and d["tie_word_embeddings"] is False
    assert d["layer_types"] == c.layer_types
    back = BeamConfig.from_pretrained(str(tmp_path))
    assert back == c
    assert back.config_hash() == c.config_hash()


def test_config_hash_ignores_preset_label_only():
    a = BeamConfig.from_preset("beam-tiny")
    b = BeamConfig(**{**a.to_dict(), "preset": None})
    assert a.config_hash() == b.config_hash()
    c = BeamConfig(**{**a.to_dict(), "sliding_window": 32})
    assert c.config_hash() != a.config_hash()


def test_doc_fields_are_all_in_config_json(tmp_path):
    BeamConfig().save_pretrained(str(tmp_path))
    d = json.loads((tmp_path / "config.json").read_text())
    doc_fields = """model_type arch_version vocab_size hidden_size num_hidden_layers num_attention_heads
        num_key_value_heads head_dim sliding_window layer_types rope_theta ssmax_base ssmax_exponent
        first_k_dense_replace intermediate_size moe_intermediate_size n_routed_experts
        num_experts_per_tok n_group topk_group routed_scaling_factor rms_norm_eps
        final_logit_softcapping max_position_embeddings tie_word_embeddings""".split()
    assert set(doc_fields) <= set(d)
    assert d["ssmax_base"] == 2048 and d["first_k_dense_replace"] == 3


def test_bad_layer_types_length():
    with pytest.raises(ValueError, match="layer_types has 6 entries for 7 layers"):
        BeamConfig(**{**PRESETS["beam-tiny"], "layer_types": [SLIDING] * 6})


def test_unknown_layer_type():
    with pytest.raises(ValueError, match="unknown layer_types.*'chunked_attention'"):
        BeamConfig(**{**PRESETS["beam-tiny"], "layer_types": [SLIDING] * 6 + ["chunked_attention"]})


def test_bad_layer_types_length_in_config_json(tmp_path):
    BeamConfig.from_preset("beam-tiny").save_pretrained(str(tmp_path))
    f = tmp_path / "config.json"
    d = json.loads(f.read_text())
    d["layer_types"] = d["layer_types"][:-1]
    f.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="layer_types"):
        BeamConfig.from_pretrained(str(tmp_path))


def test_unknown_field_in_config_json(tmp_path):
    BeamConfig.from_preset("beam-tiny").save_pretrained(str(tmp_path))
    f = tmp_path / "config.json"
    d = json.loads(f.read_text())
    d["n_shared_experts"] = 1
    f.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="n_shared_experts"):
        BeamConfig.from_pretrained(str(tmp_path))


def test_bad_json(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 288,')
    with pytest.raises(ValueError, match="config.json.*not valid JSON"):
        BeamConfig.from_pretrained(str(tmp_path))


def test_missing_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        BeamConfig.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("change, words", [
    (dict(model_type="llama"), "model_type"),
    (dict(arch_version=99), "arch_version"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(n_group=5), "n_group"),
    (dict(topk_group=0), "topk_group"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(n_group=16), "at least 2 experts"),
    (dict(head_dim=15), "head_dim"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings"),
])
def test_invalid_fields_are_named(change, words):
    with pytest.raises(ValueError, match=words):
        BeamConfig(**{**PRESETS["beam-tiny"], **change})


def test_unknown_preset_lists_presets():
    with pytest.raises(KeyError) as e:
        BeamConfig.from_preset("beam-huge")
    msg = str(e.value)
    assert "beam-huge" in msg
    for name in PRESETS:
        assert name in msg


def test_config_module_does_not_import_torch():
    """config.py itself stays torch-free (its docstring's contract). Note: importing it as
    `beam_model.config` still runs `beam_model/__init__.py`, which imports the model and torch."""
    import ast

    import beam_model.config as mod

    tree = ast.parse(open(mod.__file__).read())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert "torch" not in imported
    assert not imported & {"beam_model", "workbench"}
