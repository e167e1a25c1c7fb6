"""Token streams for training and evaluation: each split's files encoded as plain text (special-token
spellings stay text), joined by the end token `<|end|>`, so a window may span a file boundary and the
model learns where files end.

Training draws windows of `seq_len + 1` tokens at uniformly random offsets (a seeded generator);
evaluation reads the held-out stream in consecutive windows, each predicting its tokens after the first.
Bits per byte count the predicted tokens' UTF-8 bytes exactly (an end token has none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenStream:
    ids: torch.Tensor        # int64 [n]
    token_bytes: torch.Tensor  # int64 [vocab]: UTF-8 bytes per id (special tokens 0)
    files: int
    text_bytes: int

    def __len__(self) -> int:
        return self.ids.numel()


def encode_files(tokenizer, texts: list[str]) -> TokenStream:
    """`texts` (whole files) as one stream, each file followed by the end token."""
    ids: list[int] = []
    for encoded in tokenizer.encode_batch(texts, allow_special=False):
        ids += encoded
        ids.append(tokenizer.eos_token_id)
    special = set(tokenizer.special_ids.values())
    lengths = [0 if i in special else len(b) for i, b in enumerate(tokenizer.token_bytes())]
    return TokenStream(torch.tensor(ids, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64),
                       len(texts), sum(len(t.encode("utf-8")) for t in texts))


def random_windows(stream: TokenStream, batch: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """[batch, seq_len + 1] windows at random offsets."""
    if len(stream) < seq_len + 2:
        raise ValueError(f"the training stream has {len(stream)} tokens, fewer than a window of {seq_len + 1}")
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=generator)
    return torch.stack([stream.ids[s:s + seq_len + 1] for s in starts.tolist()])


def eval_windows(stream: TokenStream, seq_len: int, max_tokens: int | None = None) -> torch.Tensor:
    """[n, seq_len + 1] consecutive windows from the start (overlapping by one token, so every token but
    the first is predicted once), at most `max_tokens` predicted tokens; the tail shorter than a window is
    left out."""
    n = (len(stream) - 1) // seq_len
    if max_tokens is not None:
        n = min(n, max(1, max_tokens // seq_len))
    if n < 1:
        raise ValueError(f"the held-out stream has {len(stream)} tokens, fewer than a window of {seq_len + 1}")
    return torch.stack([stream.ids[i * seq_len:(i + 1) * seq_len + 1] for i in range(n)])


def held_out_batch(tokenizer, batch: int, tokens: int) -> torch.Tensor:
    """[batch, tokens] ids of held-out text: the held-out files in order, each followed by the end token
    (real text a model trained here never saw; the gates capture activations on it)."""
    from workbench.training.corpus import corpus_files, split

    need, ids = batch * tokens, []
    for f in split(corpus_files())[1]:
        ids += tokenizer.encode(f.read(), allow_special=False) + [tokenizer.eos_token_id]
        if len(ids) >= need:
            return torch.tensor(ids[:need], dtype=torch.int64).view(batch, tokens)
    raise ValueError(f"the held-out files hold {len(ids)} tokens, fewer than {batch} x {tokens}")
