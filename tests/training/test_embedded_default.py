"""The embedded trained model: `generate` and `serve` run it when neither --model nor --preset is given
(here a beam-tiny trained for a few steps by `workbench train`, named by $BEAM_EMBEDDED_MODEL); a lock's
own preset comes first, and a lock made on another config falls back to beam-tiny."""

import json
import os
import signal
import types

import pytest

from workbench.cli import main
from workbench.commands import common


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    corpus_dir = tmp_path_factory.mktemp("corpus")
    for i in range(40):
        (corpus_dir / f"mod_{i}.py").write_text(f"def f_{i}(x):\n    return x + {i}\n")
    out = tmp_path_factory.mktemp("models") / "beam-trained"
    assert main(["train", str(out), "--config", "beam-tiny", "--corpus", str(corpus_dir), "--vocab-size", "300",
                 "--steps", "4", "--batch", "2", "--seq-len", "16", "--warmup", "1", "--eval-every", "0",
                 "--eval-tokens", "32", "--device", "cpu"]) == 0
    return str(out)


@pytest.fixture
def embedded(trained, monkeypatch):
    monkeypatch.setenv("BEAM_EMBEDDED_MODEL", trained)
    return trained


def _args(**kw):
    return types.SimpleNamespace(**{"model": None, "preset": None, **kw})


def _lock(**model):
    return types.SimpleNamespace(model=model)


def test_generate_runs_the_embedded_model_by_default(embedded, capsys):
    assert main(["generate", "--prompt", "def f_3(x):", "--max-tokens", "3", "--device", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == embedded and out["prompt_tokens"] < len("def f_3(x):")  # the BPE, not bytes


def test_a_preset_or_a_lock_chooses_before_the_embedded_model(embedded):
    from beam_model.config import BeamConfig

    args = _args(preset="beam-tiny")
    common.choose_model(args)
    assert args.model is None and args.preset == "beam-tiny"
    args = _args()
    common.choose_model(args, _lock(preset="beam-small", config_hash="x"))
    assert args.preset == "beam-small" and args.model is None
    made_here = BeamConfig.from_pretrained(embedded).config_hash()
    args = _args()
    common.choose_model(args, _lock(preset="beam-trained", config_hash=made_here))
    assert args.model == embedded
    args = _args()
    common.choose_model(args, _lock(preset="elsewhere", config_hash="0" * 16))
    assert args.model is None and args.preset == common.FALLBACK_PRESET
    # a lock made on the embedded model's config serves it (its checkpoint says its weights' format) ...
    args = _args(weights=None)
    common.choose_model(args, _lock(preset="beam-tiny", config_hash=made_here, weights="fp8"))
    assert args.model == embedded and args.weights is None
    # ... and a preset the lock was made on takes the lock's weights
    args = _args(weights=None)
    common.choose_model(args, _lock(preset="beam-small", config_hash="x", weights="nvfp4"))
    assert args.preset == "beam-small" and args.weights == "nvfp4"


def test_without_an_embedded_model_the_fallback_preset_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("BEAM_EMBEDDED_MODEL", str(tmp_path / "absent"))
    args = _args()
    common.choose_model(args)
    assert args.model is None and args.preset == common.FALLBACK_PRESET


def test_serve_answers_with_the_embedded_model(trained):
    from tests.server_harness import ServerProcess

    srv = ServerProcess(model=(), scripted=False, num_pages=64, env={"BEAM_EMBEDDED_MODEL": trained})
    try:
        client = srv.client()
        name = os.path.basename(trained)
        assert [m.id for m in client.models.list().data] == [name]
        kw = dict(model=name, prompt="def f_1(x):", max_tokens=6, temperature=0)
        full = client.completions.create(**kw).choices[0].text
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
        assert streamed == full
    finally:
        assert srv.stop() in (0, -signal.SIGTERM), srv.log()


COMMITTED = common.EMBEDDED_MODEL
needs_beam_mini = pytest.mark.skipif(not os.path.isfile(os.path.join(COMMITTED, "model.safetensors")),
                                     reason="models/beam-mini is not in this checkout")


@needs_beam_mini
def test_the_committed_beam_mini_beats_xz_on_the_held_out_files():
    figures = json.loads(open(os.path.join(COMMITTED, "training.json")).read())
    assert figures["config"] == "beam-mini" and figures["corpus"]["held_out_files"] > 0
    assert figures["checkpoint"]["bits_per_byte"] < figures["xz_9"]["concatenated_bits_per_byte"]
    card = open(os.path.join(COMMITTED, "README.md")).read()
    assert f"| beam-mini | {figures['checkpoint']['bits_per_byte']:.4f} |" in card


@needs_beam_mini
def test_serve_without_arguments_answers_with_beam_mini(monkeypatch):
    from tests.server_harness import ServerProcess

    monkeypatch.delenv("BEAM_EMBEDDED_MODEL", raising=False)
    srv = ServerProcess(model=(), scripted=False, num_pages=64)
    try:
        client = srv.client()
        assert [m.id for m in client.models.list().data] == ["beam-mini"]
        kw = dict(model="beam-mini", prompt="def fibonacci(n):", max_tokens=12, temperature=0)
        full = client.completions.create(**kw).choices[0].text
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
        assert streamed == full and full
    finally:
        assert srv.stop() in (0, -signal.SIGTERM), srv.log()


def test_a_preset_whose_vocab_is_padded_past_the_tokenizers_draws_only_its_ids(capsys):
    """beam-tiny's 288 logits cover the byte tokenizer's 265 ids and padding: padding is never drawn."""
    from beam_model.tokenizer import ByteTokenizer

    for seed in range(3):
        assert main(["generate", "--preset", "beam-tiny", "--prompt", "hi", "--max-tokens", "64", "--temperature",
                     "1.0", "--seed", str(seed), "--device", "cpu", "--json"]) == 0
        tokens = json.loads(capsys.readouterr().out)["tokens"]
        assert tokens and max(tokens) < ByteTokenizer().vocab_size
