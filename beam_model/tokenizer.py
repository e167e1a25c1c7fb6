"""Tokenizers for Beam.

`ByteTokenizer` is a dependency-free byte-level tokenizer used by the small
presets (ids 0..255 are raw UTF-8 bytes, the chat special tokens follow).
`HFTokenizer` wraps a Hugging Face `tokenizer.json` with the same interface.
Both hand out a `StreamDecoder` so a server can turn generated ids into text
one token at a time without emitting half of a multi-byte character.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Iterable

# Order is part of the byte-level vocabulary: SPECIAL_TOKENS[i] has id 256 + i.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|think|>",
    "<|/think|>", "<|tool_call|>", "<|/tool_call|>", "<|end|>",
)
EOS_TOKEN = "<|end|>"
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")


class StreamDecoder:
    """Incremental detokenizer: `feed(id)` returns the newly completed text.

    Decodes a small window of recent ids and only emits text once it does not
    end in U+FFFD, i.e. once a multi-byte character is complete. The window
    starts one chunk back so tokenizers whose output depends on the previous
    token (leading-space handling) still give the right text.
    """

    def __init__(self, decode_fn: Callable[[list[int]], str]):
        self._decode = decode_fn
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this have been emitted

    def feed(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return new_text[len(prefix_text):]
        return ""

    def finish(self) -> str:
        """Flush held-back text (an incomplete sequence becomes U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text):]


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then SPECIAL_TOKENS from 256."""

    chat_template: str | None = None  # no checkpoint template: beam_model.chat_template renders

    def __init__(self) -> None:
        self.special_ids: dict[str, int] = {t: 256 + i for i, t in enumerate(SPECIAL_TOKENS)}
        self._id_to_special = {i: t for t, i in self.special_ids.items()}
        self.eos_token_id: int = self.special_ids[EOS_TOKEN]

    @property
    def vocab_size(self) -> int:
        return 256 + len(SPECIAL_TOKENS)

    def token_to_id(self, token: str) -> int:
        if token in self.special_ids:
            return self.special_ids[token]
        raw = token.encode("utf-8")
        if len(raw) == 1:
            return raw[0]
        raise KeyError(f"{token!r} is not a single token of the byte tokenizer")

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        if not allow_special:
            return list(text.encode("utf-8"))
        ids: list[int] = []
        # re.split with a capture group alternates plain text and special tokens.
        for i, piece in enumerate(_SPECIAL_RE.split(text)):
            if i % 2:
                ids.append(self.special_ids[piece])
            else:
                ids.extend(piece.encode("utf-8"))
        return ids

    def encode_batch(self, texts: list[str], allow_special: bool = True) -> list[list[int]]:
        return [self.encode(text, allow_special) for text in texts]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            if 0 <= i < 256:
                buf.append(i)
                continue
            if i not in self._id_to_special:
                raise ValueError(f"token id {i} out of range for vocab size {self.vocab_size}")
            # A special token ends any pending byte run; decode it on its own.
            out.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            if not skip_special:
                out.append(self._id_to_special[i])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(lambda ids: self.decode(ids, skip_special=skip_special))

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes (a special token's are its text): the vocabulary a grammar engine matches."""
        return [bytes([i]) for i in range(256)] + [t.encode() for t in SPECIAL_TOKENS]


class HFTokenizer:
    """A Hugging Face `tokenizer.json` behind the ByteTokenizer interface. `chat_template` is the Jinja
    template of the `tokenizer_config.json` beside it ("chat_template"), or None where there is none."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer  # imported lazily: byte presets don't need it

        self.path = str(path)
        self._tok = Tokenizer.from_file(self.path)
        added = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}
        # Only added tokens are matched atomically in text, so require them there.
        missing = [t for t in SPECIAL_TOKENS if t not in added]
        if missing:
            raise ValueError(f"{self.path}: special token(s) {', '.join(missing)} "
                             "missing from the tokenizer's added tokens")
        self.special_ids: dict[str, int] = {t: added[t] for t in SPECIAL_TOKENS}
        self.eos_token_id: int = self.special_ids[EOS_TOKEN]
        self._plain_tok = None  # copy that encodes special-token strings as text
        self.chat_template: str | None = _config_chat_template(Path(self.path).with_name("tokenizer_config.json"))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise KeyError(f"{token!r} is not in the vocabulary of {self.path}")
        return i

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        return self._for(allow_special).encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], allow_special: bool = True) -> list[list[int]]:
        """`encode` of each text, the texts spread over the cores (a corpus: a few seconds, not tens)."""
        tok = self._for(allow_special)
        # without offsets where this version of tokenizers offers it: the ids are the same, sooner
        batch = getattr(tok, "encode_batch_fast", tok.encode_batch)
        return [e.ids for e in batch(texts, add_special_tokens=False)]

    def _for(self, allow_special: bool):
        """The tokenizer that encodes with special-token spellings matched (allow_special) or as text."""
        if allow_special:
            return self._tok
        # A separate instance rather than toggling the flag on the shared
        # one, so concurrent encodes never see each other's setting.
        if self._plain_tok is None:
            from tokenizers import Tokenizer

            plain = Tokenizer.from_str(self._tok.to_str())
            plain.encode_special_tokens = True
            self._plain_tok = plain
        return self._plain_tok

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        ids = list(ids)
        n = self.vocab_size
        for i in ids:
            # HF silently drops unknown ids; fail loudly like ByteTokenizer.
            if not 0 <= i < n or self._tok.id_to_token(i) is None:
                raise ValueError(f"token id {i} out of range for vocab size {n}")
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(lambda ids: self.decode(ids, skip_special=skip_special))

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes (an added token's are its text): the vocabulary a grammar engine matches.
        Only byte-level BPE vocabularies (GPT-2's byte-to-character table) are read; another kind is
        refused, naming the token that is not byte-level."""
        chars = {c: b for b, c in _byte_to_char().items()}
        added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
        out = []
        for i in range(self.vocab_size):
            token = added.get(i) or self._tok.id_to_token(i)
            if i in added or token is None:
                out.append((token or "").encode())
            elif all(c in chars for c in token):
                out.append(bytes(chars[c] for c in token))
            else:
                raise ValueError(f"{self.path}: token {i} ({token!r}) is not byte-level BPE; grammar-"
                                 "constrained decoding needs a byte-level vocabulary")
        return out


def _config_chat_template(path: Path) -> str | None:
    """The "chat_template" string of a tokenizer_config.json, None if the file or the key is absent."""
    import json

    if not path.is_file():
        return None
    template = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{path}: chat_template must be a string (named templates are not supported)")
    return template


def _byte_to_char() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE (GPT-2's): printable Latin-1 bytes
    stand for themselves, the other 68 bytes take the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def save_hf_tokenizer(directory: str | Path) -> Path:
    """Write the byte-level tokenizer as a Hugging Face tokenizer folder (tokenizer.json +
    tokenizer_config.json) with the same ids: byte b is id b, SPECIAL_TOKENS follow from 256, no
    merges, nothing added around a prompt. For tools that need `AutoTokenizer.from_pretrained(dir)`
    (benchmark clients counting tokens). `HFTokenizer(dir/tokenizer.json)` encodes and decodes
    exactly like `ByteTokenizer`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    table = _byte_to_char()
    tok = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(256, 256 + len(SPECIAL_TOKENS)))
    return save_tokenizer_folder(tok, directory)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def save_tokenizer_folder(tok, directory: str | Path) -> Path:
    """Write a `tokenizers.Tokenizer` with Beam's special tokens as a Hugging Face tokenizer folder:
    tokenizer.json, and tokenizer_config.json with the special tokens and the chat template (Jinja)
    that transformers and serving engines read."""
    import json

    from beam_model.chat_template import CHAT_TEMPLATE_JINJA

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN,
              "additional_special_tokens": [t for t in SPECIAL_TOKENS if t != EOS_TOKEN],
              "model_max_length": 1 << 30, "clean_up_tokenization_spaces": False,
              "chat_template": CHAT_TEMPLATE_JINJA}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """The tokenizer files of folder `src` copied into `dst`; returns the names copied."""
    import shutil

    found = [name for name in TOKENIZER_FILES if (Path(src) / name).is_file()]
    for name in found:
        shutil.copy(Path(src) / name, Path(dst) / name)
    return found


def load_tokenizer(model_dir: str | Path | None) -> ByteTokenizer | HFTokenizer:
    """`model_dir/tokenizer.json` if present (with the chat template of `tokenizer_config.json` beside it,
    if any), else the byte-level tokenizer."""
    if model_dir is not None:
        path = Path(model_dir) / "tokenizer.json"
        if path.is_file():
            return HFTokenizer(path)
    return ByteTokenizer()
