"""Tests for beam_model.tokenizer: byte tokenizer, HF wrapper, stream decoding."""

import pytest

from beam_model.tokenizer import (
    SPECIAL_TOKENS,
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer,
)

SAMPLES = [
    "",
    "hello world",
    "héllo wörld — ünïcödé",
    "日本語のテキスト",
    "emoji 😀👍🏽 and flag 🇳🇴 and family 👨‍👩‍👧",
]


def stream(tok, ids):
    dec = tok.stream_decoder()
    chunks = [dec.feed(i) for i in ids]
    return chunks, dec.finish()


# ------------------------------------------------------------ ByteTokenizer

def test_byte_special_ids_and_vocab():
    tok = ByteTokenizer()
    assert tok.vocab_size == 265
    assert tok.special_ids == {t: 256 + i for i, t in enumerate(SPECIAL_TOKENS)}
    assert list(tok.special_ids) == [
        "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|think|>",
        "<|/think|>", "<|tool_call|>", "<|/tool_call|>", "<|end|>",
    ]
    assert tok.eos_token_id == tok.token_to_id("<|end|>") == 264
    assert tok.token_to_id("a") == 97
    with pytest.raises(KeyError):
        tok.token_to_id("ab")


@pytest.mark.parametrize("text", SAMPLES)
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_special_tokens_in_text():
    tok = ByteTokenizer()
    text = "<|user|>hi 😀<|end|><|assistant|>"
    ids = tok.encode(text)
    assert ids[0] == 257 and ids[-2:] == [264, 258]
    assert ids[1:-2] == list("hi 😀".encode())
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special=True) == "hi 😀"
    # Without allow_special the markers are just bytes.
    plain = tok.encode(text, allow_special=False)
    assert max(plain) < 256 and tok.decode(plain) == text


def test_byte_decode_errors_and_invalid_utf8():
    tok = ByteTokenizer()
    assert tok.decode([0xFF, ord("a")]) == "\ufffda"
    # A truncated sequence before a special token is replaced, not merged.
    assert tok.decode([0xE2, 0x82, 264]) == "\ufffd<|end|>"
    for bad in (265, 1000, -1):
        with pytest.raises(ValueError, match=str(bad)):
            tok.decode([97, bad])


@pytest.mark.parametrize("text", SAMPLES + ["<|think|>ok€<|/think|>😀<|end|>"])
def test_byte_stream_decoder_matches_decode(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    chunks, tail = stream(tok, ids)
    assert "".join(chunks) == text and tail == ""
    assert all("\ufffd" not in c for c in chunks)


def test_byte_stream_holds_back_split_character():
    tok = ByteTokenizer()
    dec = tok.stream_decoder()
    # "€" is E2 82 AC; nothing comes out until the last byte arrives.
    assert dec.feed(ord("a")) == "a"
    assert dec.feed(0xE2) == ""
    assert dec.feed(0x82) == ""
    assert dec.feed(0xAC) == "€"
    assert dec.feed(tok.eos_token_id) == "<|end|>"
    # An incomplete sequence at the end is flushed as U+FFFD by finish().
    assert dec.feed(0xF0) == "" and dec.feed(0x9F) == ""
    assert dec.finish() == "\ufffd"
    assert dec.finish() == ""


def test_byte_stream_skip_special():
    tok = ByteTokenizer()
    dec = tok.stream_decoder(skip_special=True)
    out = "".join(dec.feed(i) for i in tok.encode("a<|end|>b")) + dec.finish()
    assert out == "ab"


# -------------------------------------------------------------- HFTokenizer

def build_hf_tokenizer(path, specials=SPECIAL_TOKENS):
    """Train a tiny byte-level BPE in-test and save it as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(SAMPLES * 5 + ["the quick brown fox jumps"] * 5, trainer)
    tok.save(str(path))
    return path


@pytest.fixture
def hf_dir(tmp_path):
    build_hf_tokenizer(tmp_path / "tokenizer.json")
    return tmp_path


def test_load_tokenizer_picks_implementation(hf_dir, tmp_path_factory):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer(str(tmp_path_factory.mktemp("empty"))), ByteTokenizer)
    assert isinstance(load_tokenizer(str(hf_dir)), HFTokenizer)


def test_hf_special_ids(hf_dir):
    tok = load_tokenizer(str(hf_dir))
    assert set(tok.special_ids) == set(SPECIAL_TOKENS)
    for name, i in tok.special_ids.items():
        assert tok.token_to_id(name) == i
    assert tok.eos_token_id == tok.special_ids["<|end|>"]
    assert tok.vocab_size > max(tok.special_ids.values())
    with pytest.raises(KeyError):
        tok.token_to_id("definitely-not-a-token")


@pytest.mark.parametrize("text", SAMPLES + ["the quick brown fox"])
def test_hf_round_trip_and_stream(hf_dir, text):
    tok = load_tokenizer(str(hf_dir))
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    chunks, tail = stream(tok, ids)
    assert "".join(chunks) + tail == text
    assert all("\ufffd" not in c for c in chunks)


def test_hf_special_tokens_in_text(hf_dir):
    tok = load_tokenizer(str(hf_dir))
    text = "<|user|>héllo 😀<|end|><|assistant|>"
    ids = tok.encode(text)
    sp = tok.special_ids
    assert ids[0] == sp["<|user|>"] and ids[-2:] == [sp["<|end|>"], sp["<|assistant|>"]]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special=True) == "héllo 😀"
    plain = tok.encode(text, allow_special=False)
    assert not set(plain) & set(sp.values())
    assert tok.decode(plain) == text
    # The plain-encoding path must not leak into later special-aware encodes.
    assert tok.encode(text) == ids
    chunks, tail = stream(tok, ids)
    assert "".join(chunks) + tail == text


@pytest.mark.parametrize("kind", ["byte", "hf"])
def test_a_batch_encodes_as_each_text_alone(kind, hf_dir):
    """`encode_batch` (a corpus at once, over the cores) gives each text's `encode`, special-token
    spellings matched or kept as text."""
    tok = ByteTokenizer() if kind == "byte" else load_tokenizer(str(hf_dir))
    texts = [*SAMPLES, "<|user|>héllo 😀<|end|><|assistant|>"]
    for allow_special in (True, False):
        assert tok.encode_batch(texts, allow_special) == [tok.encode(t, allow_special) for t in texts]


def test_hf_decode_out_of_range(hf_dir):
    tok = load_tokenizer(str(hf_dir))
    with pytest.raises(ValueError, match=str(tok.vocab_size + 5)):
        tok.decode([tok.vocab_size + 5])


def test_hf_missing_special_token(tmp_path):
    path = build_hf_tokenizer(tmp_path / "tokenizer.json",
                              specials=[t for t in SPECIAL_TOKENS if t != "<|tool|>"])
    with pytest.raises(ValueError, match=r"<\|tool\|>"):
        HFTokenizer(path)


def test_hf_stream_holds_back_split_character(hf_dir):
    tok = load_tokenizer(str(hf_dir))
    text = "🦀 ☃ €"  # not in the training data, so each is several byte tokens
    ids = tok.encode(text)
    assert len(ids) > len(text)
    dec = tok.stream_decoder()
    chunks = [dec.feed(i) for i in ids]
    assert "" in chunks  # something was held back mid-character
    assert "".join(chunks) + dec.finish() == text
    assert all("\ufffd" not in c for c in chunks)
