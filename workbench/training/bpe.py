"""Beam's own tokenizer: a byte-level BPE trained with the `tokenizers` library on the corpus's training
files, with Beam's chat special tokens; `beam_model.tokenizer.save_tokenizer_folder` saves it the way Hugging
Face checkpoints ship a tokenizer.

Byte-level: every text, any Unicode, encodes (the 256 byte symbols are the initial alphabet) and decodes
back exactly; no normalizer, no prefix space, GPT-2's pre-tokenizer split. The special tokens
(`beam_model.tokenizer.SPECIAL_TOKENS`) take ids 0..8 and count in the vocabulary size; they are added
tokens, matched only where a caller allows special tokens, never merged out of plain text. Training is
deterministic: the same texts in the same order give the same tokenizer.json.
"""

from __future__ import annotations

from typing import Iterable

from beam_model.tokenizer import SPECIAL_TOKENS

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


def compression(tok, texts: list[str]) -> dict:
    """Bytes (UTF-8) and tokens of `texts` encoded as plain text (special-token spellings are text), and
    their ratio, bytes per token."""
    from tokenizers import Tokenizer

    plain = Tokenizer.from_str(tok.to_str())
    plain.encode_special_tokens = True
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    n_tokens = sum(len(e.ids) for e in plain.encode_batch(texts, add_special_tokens=False))
    return {"bytes": n_bytes, "tokens": n_tokens, "bytes_per_token": n_bytes / n_tokens if n_tokens else 0.0}
