"""workbench.training.bpe on a tiny corpus: exact round trips, atomic special tokens, determinism."""

import random

import pytest

from beam_model.tokenizer import SPECIAL_TOKENS, HFTokenizer, save_tokenizer_folder
from workbench.training import bpe

TEXTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nimport sys\n\nfor name in sorted(os.listdir('.')):\n    print(name, file=sys.stderr)\n",
    '"""A docstring with ünïcödé, 日本語 and 😀."""\n',
] * 3

SAMPLES = [
    "",
    "def f(x):\n\treturn x  # tab, CRLF\r\n",
    "\x00\x01\x07\x1b[0m\x7f\x80\x9f",  # NUL, controls, C1 controls
    "héllo wörld — ünïcödé, e\u0301 (combining), \u200b\u200d zero widths, \ufeffBOM",
    "日本語のテキスト, 한국어, עִברִית, العربية",
    "emoji 😀👍🏽 🇳🇴 👨‍👩‍👧 \U0010fffd \ue000 \ufffd",
    "    " * 30 + "deep\n\n\n",
    "<|end|> <|user|>x<|/think|> <| end |> <|end|<|end|>",  # special-token spellings as text
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer_folder(bpe.train_bpe(TEXTS, vocab_size=320), out)
    return out


def random_texts(seed=0, n=30):
    rng = random.Random(seed)
    planes = [(0x20, 0x7f), (0x0, 0x20), (0x80, 0x800), (0x800, 0xd800), (0xe000, 0x10000), (0x10000, 0x110000)]
    out = []
    for _ in range(n):
        chars = []
        for _ in range(rng.randrange(1, 40)):
            lo, hi = rng.choice(planes)
            chars.append(chr(rng.randrange(lo, hi)))
        out.append("".join(chars))
    return out


def test_vocabulary_size_and_determinism(trained):
    tok = bpe.train_bpe(TEXTS, vocab_size=320)
    assert tok.get_vocab_size(with_added_tokens=True) == 320
    assert tok.to_str() == bpe.train_bpe(TEXTS, vocab_size=320).to_str()
    assert (trained / "tokenizer.json").read_text() == tok.to_str(pretty=True)
    with pytest.raises(ValueError, match="below"):
        bpe.train_bpe(TEXTS, vocab_size=200)


@pytest.mark.parametrize("text", SAMPLES + random_texts())
def test_round_trip_is_exact(trained, text):
    tok = HFTokenizer(trained / "tokenizer.json")
    table = tok.token_bytes()
    for allow_special in (True, False):
        ids = tok.encode(text, allow_special=allow_special)
        assert tok.decode(ids) == text
        dec = tok.stream_decoder()
        assert "".join(dec.feed(i) for i in ids) + dec.finish() == text
    plain = tok.encode(text, allow_special=False)
    assert b"".join(table[i] for i in plain) == text.encode("utf-8")  # the byte view agrees too


def test_every_byte_is_a_token(trained):
    table = HFTokenizer(trained / "tokenizer.json").token_bytes()
    assert {bytes([b]) for b in range(256)} <= set(table)


def test_special_tokens_are_single_ids_never_made_from_text(trained):
    tok = HFTokenizer(trained / "tokenizer.json")
    special = set(tok.special_ids.values())
    assert len(special) == len(SPECIAL_TOKENS)
    for name in SPECIAL_TOKENS:
        assert tok.encode(name) == [tok.special_ids[name]]
        ids = tok.encode(f"x{name}y")
        assert ids.count(tok.special_ids[name]) == 1 and not special - {tok.special_ids[name]} & set(ids)
        assert not special & set(tok.encode(name, allow_special=False))
    for text in SAMPLES + TEXTS:
        assert not special & set(tok.encode(text, allow_special=False))
    # No learned token spells a special token (or a run across one) either.
    table = tok.token_bytes()
    for i, token in enumerate(table):
        if i not in special:
            assert not any(name.encode() in token for name in SPECIAL_TOKENS)
