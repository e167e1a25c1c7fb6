"""Quantized checkpoints (FP8 per channel, NVFP4): the formats' rounding, saturation and layout; a
checkpoint written by an independent quantizer that follows the documented layout loads and matches its
float64 dequantization; `workbench quantize` round trips; every malformed checkpoint is refused with the
tensor or field named."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from beam_model.model import BeamForCausalLM
from beam_model.quant import formats
from beam_model.quant.scheme import QuantConfigError, QuantScheme, read_config
from beam_model.tp import load_shard
from beam_model.weights import CheckpointError, checkpoint_tensors
from workbench.cli import main

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# ---------------------------------------------------------------------------------------- formats

@pytest.mark.parametrize("x, value", [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0),
                                      (3.5, 4.0), (5.0, 4.0), (5.1, 6.0), (9.0, 6.0), (-0.3, -0.5),
                                      (-0.2, 0.0), (2.9, 3.0)])
def test_e2m1_rounds_to_nearest_ties_to_even_and_saturates(x, value):
    code = formats.e2m1_codes(torch.tensor([x]))
    assert formats.e2m1_values(code).item() == value
    assert code.item() != 8  # no negative zero


def test_every_e2m1_code_decodes_to_its_value():
    codes = torch.arange(16, dtype=torch.uint8)
    assert formats.e2m1_values(codes).tolist() == E2M1 + [-v for v in E2M1]


def test_the_even_input_sits_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = formats.pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert torch.equal(formats.unpack_nibbles(packed), codes)


def test_fp8_scales_are_row_amax_over_448_and_saturate():
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [448.0 * 3, 1.0, -7.0]])
    q, scale = formats.quantize_fp8(w)
    assert scale.shape == (3, 1) and scale[:, 0].tolist() == pytest.approx([2.0 / 448, 1.0, 3.0], rel=1e-7)
    assert q.dtype == torch.float8_e4m3fn and q.float().abs().max() == 448.0
    assert torch.equal(formats.dequantize_fp8(q, scale)[1], torch.zeros(3))
    assert formats.to_e4m3(torch.tensor([1e6, -1e6])).float().tolist() == [448.0, -448.0]


def test_nvfp4_scales_and_zero_blocks():
    w = torch.zeros(2, 32)
    w[0, :16] = torch.linspace(-3.0, 3.0, 16)
    q, scale, scale_2 = formats.quantize_nvfp4(w)
    assert q.shape == (2, 16) and scale.shape == (2, 2) and scale_2.shape == ()
    assert scale_2.item() == pytest.approx(3.0 / (448 * 6))
    assert scale.float()[0, 0].item() == 448.0 and scale.float()[1].tolist() == [0.0, 0.0]
    back = formats.dequantize_nvfp4(q, scale, scale_2)
    assert torch.equal(back[1], torch.zeros(32)) and back[0, 0].item() == pytest.approx(-3.0)
    with pytest.raises(ValueError, match="multiple of 16"):
        formats.quantize_nvfp4(torch.ones(2, 24))


# ---------------------------------------------------------------------------------------- checkpoints

@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("bf16"))
    BeamForCausalLM.from_preset("beam-tiny", dtype=torch.bfloat16, seed=5).save_pretrained(path)
    return path


def _independent_fp8(w64):
    scale = w64.abs().amax(1, keepdim=True) / 448.0
    return (w64 / scale).to(torch.float32).to(torch.float8_e4m3fn), scale.to(torch.float32)


def _independent_nvfp4(w64):
    """The documented NVFP4 layout, written without the project's code: nearest grid value by argmin."""
    rows, cols = w64.shape
    scale_2 = w64.abs().max() / (448.0 * 6.0)
    blocks = w64.view(rows, cols // 16, 16)
    scale = (blocks.abs().amax(-1) / 6.0 / scale_2).to(torch.float32).to(torch.float8_e4m3fn)
    x = blocks / (scale.to(torch.float64) * scale_2).unsqueeze(-1)
    grid = torch.tensor(E2M1, dtype=torch.float64)
    idx = (x.abs().clamp(max=6.0).unsqueeze(-1) - grid).abs().argmin(-1)
    codes = (idx | ((x < 0) & (idx > 0)).long() << 3).view(rows, cols)
    packed = torch.zeros(rows, cols // 2, dtype=torch.uint8)
    for i in range(cols // 2):
        packed[:, i] = (codes[:, 2 * i] + 16 * codes[:, 2 * i + 1]).to(torch.uint8)
    return packed, scale, scale_2.to(torch.float32).reshape(())


def _float64_dequant(tensors, module, algo):
    w = tensors[f"{module}.weight"]
    if algo == "fp8":
        return w.to(torch.float64) * tensors[f"{module}.weight_scale"].to(torch.float64)
    codes = torch.stack([w & 15, w >> 4], -1).view(w.shape[0], -1).long()
    grid = torch.tensor(E2M1, dtype=torch.float64)
    values = torch.where(codes >= 8, -1.0, 1.0).double() * grid[codes & 7]
    scale = tensors[f"{module}.weight_scale"].to(torch.float64).repeat_interleave(16, 1)
    return values * scale * tensors[f"{module}.weight_scale_2"].to(torch.float64)


def _dense_weights(model) -> dict[str, torch.Tensor]:
    """Every projection's weight under its checkpoint name as the reference points read it (FP32)."""
    from beam_model.quant.layout import stored
    from beam_model.quant.tensors import dense

    out = dict(checkpoint_tensors(model))
    for names, owner, attr in model.projections():
        w = dense(stored(owner, attr), torch.float32)
        for i, name in enumerate(names):
            out[f"{name}.weight"] = w[i] if len(names) > 1 else w
    return out


@pytest.mark.parametrize("algo", ["fp8", "nvfp4"])
def test_an_independently_written_checkpoint_loads_as_its_float64_dequantization(bf16_dir, tmp_path, algo):
    scheme = QuantScheme.for_format(algo)
    model = BeamForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16)
    written, modules = {}, []
    for name, t in checkpoint_tensors(model).items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and scheme.quantizes(module):
            modules.append(module)
            w64 = t.to(torch.float64)
            if algo == "fp8":
                written[name], written[f"{module}.weight_scale"] = _independent_fp8(w64)
            else:
                q, s, s2 = _independent_nvfp4(w64)
                written[name], written[f"{module}.weight_scale"], written[f"{module}.weight_scale_2"] = q, s, s2
                written[f"{module}.input_scale"] = torch.tensor(1.0)
        else:
            written[name] = t.clone()
    half = len(written) // 2  # two shards and an index, as large checkpoints ship
    names = list(written)
    save_file({n: written[n] for n in names[:half]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({n: written[n] for n in names[half:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f"model-0000{1 + (i >= half)}-of-00002.safetensors"
                                        for i, n in enumerate(names)}}))
    config = json.loads(open(os.path.join(bf16_dir, "config.json")).read())
    config["quantization_config"] = scheme.to_config()
    (tmp_path / "config.json").write_text(json.dumps(config))

    loaded = BeamForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    got = checkpoint_tensors(loaded)
    assert modules and loaded.weights == algo and set(got) == set(written)
    assert all(torch.equal(got[n].view(torch.uint8), written[n].reshape(got[n].shape).view(torch.uint8))
               for n in written if written[n].element_size() == 1)
    dense = _dense_weights(loaded)  # the stored weights as the points read them, in FP32
    for module in modules:
        want = _float64_dequant(written, module, algo)
        err = (dense[f"{module}.weight"].to(torch.float64) - want).abs().max() / want.abs().max()
        assert err < 1e-4, (module, err)
    for name, t in got.items():
        if name.rsplit(".", 1)[0] not in modules:  # the tensors no format quantizes, read as they are
            assert torch.equal(t, written[name].float()), name


@pytest.mark.parametrize("algo, bound", [("fp8", 2 ** -4), ("nvfp4", 0.26)])
def test_workbench_quantize_round_trips(bf16_dir, tmp_path, algo, bound, capsys):
    dst = tmp_path / algo
    assert main(["quantize", bf16_dir, str(dst), "--format", algo, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bytes"] < out["src_bytes"]
    config, scheme = read_config(str(dst))
    assert scheme.format == algo and config.preset == "beam-tiny"
    source = checkpoint_tensors(BeamForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32))
    back = _dense_weights(BeamForCausalLM.from_pretrained(str(dst), dtype=torch.float32))
    for name, t in source.items():
        module = name.removesuffix(".weight")
        if not scheme.quantizes(module):
            assert torch.equal(back[name], t), name
            continue
        # each weight within its format's step of its row (FP8) or of the tensor's largest (NVFP4)
        scale = t.abs().amax(1, keepdim=True) if algo == "fp8" else t.abs().max()
        assert ((back[name] - t).abs() <= bound * scale + 1e-12).all(), name
    assert main(["quantize", str(dst), str(tmp_path / "again"), "--format", algo]) == 2
    assert "already quantized" in capsys.readouterr().err


def test_a_preset_name_quantizes_its_random_weights(bf16_dir, tmp_path, capsys):
    """SRC as a preset: the same files as quantizing that preset's saved checkpoint (bf16_dir: seed 5)."""
    assert main(["quantize", "beam-tiny", str(tmp_path / "preset"), "--format", "fp8", "--seed", "5"]) == 0
    assert main(["quantize", bf16_dir, str(tmp_path / "folder"), "--format", "fp8"]) == 0
    assert "in beam-tiny)" in capsys.readouterr().out
    preset = checkpoint_tensors(BeamForCausalLM.from_pretrained(str(tmp_path / "preset")))
    folder = checkpoint_tensors(BeamForCausalLM.from_pretrained(str(tmp_path / "folder")))
    assert preset.keys() == folder.keys() and all(torch.equal(preset[n], folder[n]) for n in preset)
    assert main(["quantize", "beam-none", str(tmp_path / "x"), "--format", "fp8"]) == 2
    assert "beam-none is neither a checkpoint folder nor a preset" in capsys.readouterr().err


def test_generate_runs_a_quantized_checkpoint(bf16_dir, tmp_path, capsys):
    assert main(["quantize", bf16_dir, str(tmp_path / "q"), "--format", "nvfp4"]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path / "q"), "--max-tokens", "2", "--device", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["completion_tokens"] >= 1


# ---------------------------------------------------------------------------------------- refusals

@pytest.fixture
def fp8_dir(bf16_dir, tmp_path):
    dst = tmp_path / "fp8"
    assert main(["quantize", bf16_dir, str(dst), "--format", "fp8"]) == 0
    return dst


def _rewrite(path, change):
    file = str(path / "model.safetensors")
    with safe_open(file, framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    change(tensors)
    save_file(tensors, file)


MODULE = "model.layers.3.mlp.experts.2.up_proj"


@pytest.mark.parametrize("change, named", [
    (lambda t: t.pop(f"{MODULE}.weight_scale"), f"missing tensors: {MODULE}.weight_scale"),
    (lambda t: t.__setitem__(f"{MODULE}.weight_scale", t[f"{MODULE}.weight_scale"].view(1, -1)),
     f"tensor {MODULE}.weight_scale has shape"),
    (lambda t: t.__setitem__(f"{MODULE}.weight_scale", t[f"{MODULE}.weight_scale"].to(torch.bfloat16)),
     f"tensor {MODULE}.weight_scale is BF16, expected F32"),
    (lambda t: t.__setitem__(f"{MODULE}.weight", t[f"{MODULE}.weight"].to(torch.bfloat16)),
     f"tensor {MODULE}.weight is BF16, expected F8_E4M3"),
    (lambda t: t.__setitem__("model.layers.3.mlp.gate.weight_scale", torch.ones(1)),
     "unexpected tensors: model.layers.3.mlp.gate.weight_scale"),
])
def test_a_malformed_tensor_is_refused_by_name(fp8_dir, change, named):
    _rewrite(fp8_dir, change)
    with pytest.raises(CheckpointError, match="FP8|fp8") as e:
        BeamForCausalLM.from_pretrained(str(fp8_dir))
    assert named in str(e.value)


def _nan_codes(t: torch.Tensor) -> torch.Tensor:
    codes = t.view(torch.uint8).clone()
    codes.view(-1)[:3] = torch.tensor([0x7F, 0xFF, 0x7F], dtype=torch.uint8)
    return codes.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("fmt, change, named", [
    ("fp8", lambda t: t.__setitem__(f"{MODULE}.weight", _nan_codes(t[f"{MODULE}.weight"])),
     f"tensor {MODULE}.weight holds E4M3 NaN codes (0x7F / 0xFF): 3 of"),
    ("fp8", lambda t: t[f"{MODULE}.weight_scale"].view(-1)[:2].fill_(float("inf")),
     f"tensor {MODULE}.weight_scale holds scales that are not finite: 2 of"),
    ("nvfp4", lambda t: t.__setitem__(f"{MODULE}.weight_scale", _nan_codes(t[f"{MODULE}.weight_scale"])),
     f"tensor {MODULE}.weight_scale holds E4M3 NaN codes (0x7F / 0xFF): 3 of"),
    ("nvfp4", lambda t: t[f"{MODULE}.weight_scale_2"].fill_(float("nan")),
     f"tensor {MODULE}.weight_scale_2 holds scales that are not finite: 1 of 1"),
])
def test_values_no_quantizer_writes_are_refused_by_name(bf16_dir, tmp_path, fmt, change, named):
    """E4M3 NaN codes (kernels that place codes by their bits read them as finite) and non-finite scales."""
    dst = tmp_path / fmt
    assert main(["quantize", bf16_dir, str(dst), "--format", fmt]) == 0
    _rewrite(dst, change)
    with pytest.raises(CheckpointError, match="holds values no quantizer writes") as e:
        BeamForCausalLM.from_pretrained(str(dst))
    assert named in str(e.value)
    with pytest.raises(CheckpointError, match="holds values no quantizer writes") as e:
        load_shard(str(dst), 0, 1)  # a rank's shard, read by itself
    assert named in str(e.value)


@pytest.mark.parametrize("edit, named", [
    ({"quant_algo": "INT4_AWQ"}, "quant_algo is 'INT4_AWQ'"),
    ({"quant_method": "gptq"}, "quant_method is 'gptq'"),
    ({"quant_algo": "NVFP4", "group_size": 32}, "group_size is 32"),
    ({"exclude_modules": "lm_head"}, "exclude_modules must be a list"),
])
def test_an_unknown_quantization_config_is_refused_by_field(fp8_dir, edit, named):
    path = fp8_dir / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"].update(edit)
    path.write_text(json.dumps(config))
    with pytest.raises(QuantConfigError) as e:
        BeamForCausalLM.from_pretrained(str(fp8_dir))
    assert named in str(e.value)


def test_accuracy_compares_the_quantized_model_with_its_source(bf16_dir, tmp_path, capsys):
    from workbench.quant_accuracy import compare

    dst = tmp_path / "nvfp4"
    assert main(["quantize", bf16_dir, str(dst), "--format", "nvfp4", "--accuracy", "64", "--seq-len", "16",
                 "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)["accuracy"]
    saved = json.loads((dst / "accuracy.json").read_text())
    assert saved == printed and saved["positions"] == 64 and saved["tokens"].startswith("random ids")
    assert 0.0 <= saved["top1_agreement"] < 1.0 and 0.0 < saved["kl_mean"] <= saved["kl_p99"]
    model = BeamForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32)
    same = compare(model, model, torch.randint(0, model.config.vocab_size, (2, 8)))
    assert same["top1_agreement"] == 1.0 and same["kl_mean"] == 0.0


# ---------------------------------------------------------------------------------- quantized models

@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_a_random_quantized_model_is_the_bf16_one_quantized(bf16_dir, tmp_path, fmt):
    """from_preset(weights=fmt) draws what the BF16 preset draws and stores it as `workbench quantize` does;
    it saves as a quantized checkpoint that reads back bit for bit."""
    assert main(["quantize", bf16_dir, str(tmp_path / "q"), "--format", fmt]) == 0
    made = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.bfloat16, seed=5, weights=fmt)
    written = BeamForCausalLM.from_pretrained(str(tmp_path / "q"))
    a, b = checkpoint_tensors(made), checkpoint_tensors(written)
    assert made.weights == written.weights == fmt and a.keys() == b.keys()
    assert all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a if a[n].element_size() == 1)
    assert all(torch.equal(a[n], b[n]) for n in a if a[n].element_size() > 1)
    made.save_pretrained(str(tmp_path / "again"))
    again = BeamForCausalLM.from_pretrained(str(tmp_path / "again"))
    assert again.weights == fmt
    ids = torch.randint(0, made.config.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(again(ids), made(ids))


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_the_points_receive_quantized_weights_where_their_spec_says(fmt):
    from beam_model.quant.tensors import is_quantized
    from workbench.points import spec

    model = BeamForCausalLM.from_preset("beam-tiny", weights=fmt)
    for layer in model.model.layers:
        for point, w in layer.prepared.items():
            point = point.split("_")[0] if point.startswith("boundary") else point
            if isinstance(w, dict):
                assert sorted(k for k, v in w.items() if is_quantized(v)) == \
                    sorted(spec(point).quantized.get(fmt, ())), (layer.index, point)


def test_a_variant_that_reads_only_bf16_is_refused_on_a_quantized_model():
    model = BeamForCausalLM.from_preset("beam-tiny", weights="fp8")
    with pytest.raises(ValueError, match="the model's weights are fp8; qkvg_proj:packed reads bf16 weights"):
        model.set_variants({"qkvg_proj": "packed"})
    BeamForCausalLM.from_preset("beam-tiny", weights="nvfp4").set_variants({"qkvg_proj": "packed"})  # BF16 there


def test_serve_refuses_a_lock_made_on_other_weights():
    import types

    from workbench.commands.serve import check_lock_matches

    model = BeamForCausalLM.from_preset("beam-tiny", weights="nvfp4")
    same = model.config.config_hash()
    check_lock_matches(types.SimpleNamespace(model={"config_hash": same, "weights": "nvfp4"}), model, force=False)
    for locked in ({"config_hash": same}, {"config_hash": same, "weights": "fp8"}):  # no field: a BF16 lock
        with pytest.raises(ValueError, match=f"made for {locked.get('weights', 'bf16')} weights, but this model's "
                                             "are nvfp4"):
            check_lock_matches(types.SimpleNamespace(model=locked), model, force=True)
