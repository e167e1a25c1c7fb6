"""Beam's own tokenizer: a byte-level BPE trained with the `tokenizers` library on the corpus's training
files, with Beam's chat special tokens, saved the way Hugging Face checkpoints ship a tokenizer.

Byte-level: every text, any Unicode, encodes (the 256 byte symbols are the initial alphabet) and decodes
back exactly; no normalizer, no prefix space, GPT-2's pre-tokenizer split. The special tokens
(`beam_model.tokenizer.SPECIAL_TOKENS`) take ids 0..8 and count in the vocabulary size; they are added
tokens, matched only where a caller allows special tokens, never merged out of plain text. Training is
deterministic: the same texts in the same order give the same tokenizer.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from beam_model.chat_template import CHAT_TEMPLATE_JINJA
from beam_model.tokenizer import EOS_TOKEN, SPECIAL_TOKENS

DEFAULT_VOCAB_SIZE = 8192


def train_bpe(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE):
    """A byte-level BPE `tokenizers.Tokenizer` of `vocab_size` ids in all, special tokens included (fewer
    when a small corpus runs out of pairs to merge)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    minimum = 256 + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(f"vocab size {vocab_size} is below {minimum} (256 bytes + {len(SPECIAL_TOKENS)} "
                         "special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def tokenizer_config() -> dict:
    """tokenizer_config.json: the special tokens and the chat template (Jinja) for transformers and engines."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN,
            "additional_special_tokens": [t for t in SPECIAL_TOKENS if t != EOS_TOKEN],
            "model_max_length": 1 << 30, "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE_JINJA}


def save(tok, directory: str | Path) -> Path:
    """Write tokenizer.json and tokenizer_config.json into `directory` (created if needed)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n", encoding="utf-8")
    return out


def compression(tok, texts: list[str]) -> dict:
    """Bytes (UTF-8) and tokens of `texts` encoded as plain text (special-token spellings are text), and
    their ratio, bytes per token."""
    from tokenizers import Tokenizer

    plain = Tokenizer.from_str(tok.to_str())
    plain.encode_special_tokens = True
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    n_tokens = sum(len(e.ids) for e in plain.encode_batch(texts, add_special_tokens=False))
    return {"bytes": n_bytes, "tokens": n_tokens, "bytes_per_token": n_bytes / n_tokens if n_tokens else 0.0}
