"""`workbench train`: beam-tiny learns on a small corpus in a few CPU steps, through the reference fusion
points with autograd; the router's balancing moves the correction bias towards even loads and routing
stays FP32 under autocast; evaluation counts bits per byte exactly; the command writes a checkpoint the
model and tokenizer loaders read back."""

import json
import math
import xml.etree.ElementTree as ET

import pytest
import torch

from beam_model.model import BeamForCausalLM
from beam_model.tokenizer import HFTokenizer, load_tokenizer, save_tokenizer_folder
from workbench.cli import main
from workbench.training import bpe
from workbench.training.data import encode_files, eval_windows, random_windows
from workbench.training.evaluate import evaluate, routing_statistics, xz_bits_per_byte
from workbench.training.lm import RouteRecorder, window_logits
from workbench.training.models import initial_model, to_bf16, training_config
from workbench.training.plot import loss_curve_svg
from workbench.training.train import Trainer, TrainOptions, balance, learning_rate

TEXTS = [f"def add_{i}(a, b):\n    '''Return a + b + {i}.'''\n    total = a + b\n    return total + {i}\n\n"
         f"class Box{i}:\n    def __init__(self, value):\n        self.value = value * {i}\n" for i in range(40)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer_folder(bpe.train_bpe(TEXTS, 300), out)
    return HFTokenizer(out / "tokenizer.json")


@pytest.fixture(scope="module")
def streams(tokenizer):
    return encode_files(tokenizer, TEXTS[:36]), encode_files(tokenizer, TEXTS[36:])


def test_beam_tiny_learns_in_a_few_steps(tokenizer, streams):
    opts = TrainOptions(config="beam-tiny", steps=40, batch=4, seq_len=32, lr=3e-3, warmup=4, eval_every=20,
                        eval_tokens=256)
    trainer = Trainer(opts, training_config("beam-tiny", tokenizer.vocab_size), *streams)
    first = trainer.evaluate(0)
    assert abs(first["loss"] - math.log(tokenizer.vocab_size)) < 1.5  # the initial logits are O(1)
    history = trainer.run()
    assert [e["step"] for e in history.evals] == [0, 20, 40]
    assert history.evals[-1]["loss"] < first["loss"] - 1.0, history.evals
    first_losses = [r[1] for r in history.train[:5]]
    last_losses = [r[1] for r in history.train[-5:]]
    assert sum(last_losses) < sum(first_losses) - 5 * 1.0
    grads = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert all(n.endswith("e_score_correction_bias") for n, p in trainer.model.named_parameters()
               if n not in grads)
    bias = trainer.model.model.layers[-1].mlp.gate.e_score_correction_bias
    assert bias.abs().sum() > 0  # the balancing rule moved it


def test_every_trainable_parameter_gets_a_gradient(tokenizer, streams):
    model = initial_model(training_config("beam-tiny", tokenizer.vocab_size), seed=1, device="cpu")
    w = random_windows(streams[0], 2, 16, torch.Generator().manual_seed(0))
    model.set_variants()
    torch.nn.functional.cross_entropy(window_logits(model, w[:, :-1]), w[:, 1:].flatten()).backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]
    assert not missing


def test_balance_raises_the_underloaded_and_lowers_the_overloaded(tokenizer):
    model = initial_model(training_config("beam-tiny", tokenizer.vocab_size), seed=0, device="cpu")
    layer = model.config.moe_layers[0]
    load = torch.arange(model.config.n_routed_experts)  # mean 7.5
    balance(model, {layer: load}, 0.01)
    bias = model.model.layers[layer].mlp.gate.e_score_correction_bias
    assert torch.equal(bias, torch.where(load < 7.5, 0.01, -0.01))


def test_routing_stays_fp32_under_autocast(tokenizer, streams):
    model = initial_model(training_config("beam-tiny", tokenizer.vocab_size), seed=2, device="cpu")
    recorder = RouteRecorder(model)
    seen = []
    model.set_variants()
    inner = model.ops.route

    def spy(x, w, **kw):
        seen.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"))
        return inner(x, w, **kw)

    model.ops.route = spy
    recorder.attach()  # wraps the spy: autocast is off inside
    w = random_windows(streams[0], 1, 8, torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        window_logits(model, w[:, :-1])
    assert seen and not any(seen)
    assert set(recorder.ids) == set(model.config.moe_layers)


def test_learning_rate_warms_up_then_follows_a_cosine():
    opts = TrainOptions(steps=110, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert learning_rate(opts, 0) == pytest.approx(0.1) and learning_rate(opts, 9) == pytest.approx(1.0)
    assert learning_rate(opts, 10) == pytest.approx(1.0) and learning_rate(opts, 60) == pytest.approx(0.55)
    assert learning_rate(opts, 110) == pytest.approx(0.1)


def test_bits_per_byte_count_the_predicted_tokens_bytes(tokenizer, streams):
    model = initial_model(training_config("beam-tiny", tokenizer.vocab_size), seed=3, device="cpu")
    e = evaluate(model, streams[1], seq_len=16, batch=3, routing=True)
    windows = eval_windows(streams[1], 16)
    targets = windows[:, 1:].flatten()
    model.set_variants()
    with torch.no_grad():
        nats = torch.nn.functional.cross_entropy(window_logits(model, windows[:, :-1]), targets, reduction="sum")
    assert e.tokens == targets.numel()
    assert e.bytes == sum(len(tokenizer.decode([t]).encode()) for t in targets.tolist()
                          if t != tokenizer.eos_token_id)
    assert e.bits_per_byte == pytest.approx(nats.item() / math.log(2) / e.bytes, rel=1e-4)
    assert set(e.routing["layers"]) == {str(i) for i in model.config.moe_layers}


def test_routing_statistics_on_known_choices():
    same = torch.tensor([[[0, 1], [0, 1], [0, 1]]])  # every token the same two experts
    s = routing_statistics({3: same}, experts=4)
    assert s["layers"]["3"]["next_token_share"] == 1.0 and s["layers"]["3"]["max_over_mean_load"] == 2.0
    disjoint = torch.tensor([[[0, 1], [2, 3], [0, 1], [2, 3]]])
    s = routing_statistics({1: disjoint}, experts=4)
    assert s["mean"]["next_token_share"] == 0.0 and s["mean"]["load_cv"] == 0.0 and s["uniform_share"] == 0.5


def test_xz_compresses_repetition_below_a_bit_per_byte():
    figures = xz_bits_per_byte(["def f(x):\n    return x\n" * 200, "import os\n" * 100])
    assert figures["concatenated_bits_per_byte"] < 1.0 <= 8.0
    assert figures["bytes"] == len("def f(x):\n    return x\n") * 200 + len("import os\n") * 100


def test_bf16_copy_keeps_the_router_fp32(tokenizer):
    model = initial_model(training_config("beam-tiny", tokenizer.vocab_size), seed=0, device="cpu")
    copy = to_bf16(model)
    dtypes = {n: p.dtype for n, p in copy.named_parameters()}
    assert dtypes["lm_head.weight"] == torch.bfloat16
    assert all(d == torch.float32 for n, d in dtypes.items() if ".mlp.gate." in n)


def test_loss_curve_is_an_svg_with_both_series():
    svg = loss_curve_svg([[1, 5.0, 1e-3], [2, 4.0, 1e-3], [3, 3.5, 1e-3]], [{"step": 3, "loss": 3.8}], "t <&>")
    root = ET.fromstring(svg)
    tags = [el.tag.split("}")[-1] for el in root.iter()]
    assert tags.count("polyline") == 2 and tags.count("circle") == 1


def test_train_command_writes_a_checkpoint_the_loaders_read(tmp_path, capsys):
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    for i, text in enumerate(TEXTS):
        (corpus_dir / f"mod_{i}.py").write_text(text)
    out = tmp_path / "ck"
    assert main(["train", str(out), "--config", "beam-tiny", "--corpus", str(corpus_dir), "--vocab-size", "300",
                 "--steps", "6", "--batch", "2", "--seq-len", "16", "--warmup", "2", "--eval-every", "3",
                 "--eval-tokens", "64", "--device", "cpu", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    figures = json.loads((out / "training.json").read_text())
    assert figures["checkpoint"]["bits_per_byte"] == summary["held_out_bits_per_byte"]
    assert figures["xz_9"]["concatenated_bits_per_byte"] == summary["xz_9_bits_per_byte"]
    assert [e["step"] for e in figures["history"]["evals"]] == [3, 6] and len(figures["history"]["train"]) == 6
    model = BeamForCausalLM.from_pretrained(str(out))
    assert model.config.preset == "beam-tiny" and model.lm_head.weight.dtype == torch.bfloat16
    tok = load_tokenizer(str(out))
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == model.config.vocab_size and tok.chat_template
    assert (out / "loss_curve.svg").read_text().startswith("<svg")
    card = (out / "README.md").read_text()
    assert f"| beam-tiny | {figures['checkpoint']['bits_per_byte']:.4f} |" in card
    assert f"{figures['xz_9']['concatenated_bits_per_byte']:.4f}" in card and "the .py files under" in card
    (out / "README.md").unlink()
    assert main(["train", str(out), "--render"]) == 0
    assert (out / "README.md").read_text() == card


def test_a_corpus_without_a_held_out_file_is_refused(tmp_path, capsys):
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    (corpus_dir / "a.py").write_text("x = 1\n")
    assert main(["train", str(tmp_path / "ck"), "--corpus", str(corpus_dir), "--steps", "1"]) == 2
    assert "needs files on both sides of the split" in capsys.readouterr().err
