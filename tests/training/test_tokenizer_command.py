"""`workbench tokenizer train`: trains on the training split only, writes the files, prints the held-out
compression. Run on a small fake standard library so it takes a second."""

import json

import pytest

import workbench.training.corpus as corpus
from beam_model.tokenizer import HFTokenizer, load_tokenizer
from workbench.cli import main
from workbench.training import bpe

HELD_MARK = "HELD_OUT_ONLY_SENTINEL"


@pytest.fixture
def fake_stdlib(tmp_path, monkeypatch):
    root = tmp_path / "stdlib"
    for i in range(60):
        rel = f"pkg{i % 4}/mod_{i}.py"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        mark = HELD_MARK if corpus.is_held_out(rel) else "train"
        (root / rel).write_text(f"def func_{i}(x):\n    '''{mark}'''\n    return x * {i}\n")
    monkeypatch.setattr(corpus, "stdlib_root", lambda: root)
    return root


def test_train_command_uses_the_training_split_only(fake_stdlib, tmp_path, monkeypatch, capsys):
    seen = []
    real_train = bpe.train_bpe

    def spy(texts, vocab_size):
        texts = list(texts)
        seen.extend(texts)
        return real_train(texts, vocab_size)

    monkeypatch.setattr(bpe, "train_bpe", spy)
    out = tmp_path / "tok"
    assert main(["tokenizer", "train", str(out), "--vocab-size", "300"]) == 0
    train, held = corpus.split(corpus.corpus_files(fake_stdlib))
    assert held and len(seen) == len(train)
    assert not any(HELD_MARK in t for t in seen)

    printed = capsys.readouterr().out
    figures = json.loads((out / "tokenizer_training.json").read_text())
    assert figures["held_out_files"] == len(held) and figures["vocab_size"] == 300
    assert figures["held_out_bytes"] == sum(len(f.path.read_bytes()) for f in held)
    assert figures["held_out_bytes_per_token"] > 1
    assert f"{figures['held_out_bytes_per_token']} bytes per token" in printed
    tok = load_tokenizer(out)
    assert isinstance(tok, HFTokenizer) and tok.chat_template
    assert tok.vocab_size == 300


def test_train_command_json(fake_stdlib, tmp_path, capsys):
    assert main(["tokenizer", "train", str(tmp_path / "t"), "--vocab-size", "280", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["vocab_size"] == 280
