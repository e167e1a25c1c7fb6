"""How far a quantized checkpoint's next-token distributions are from its BF16 source's on the same
tokens: top-1 agreement and the KL divergence KL(source || quantized) per position (mean, median,
99th percentile), both models run through the reference fusion points in FP32 on one device.

The tokens: the held-out files of the corpus (`workbench.training.corpus`) when the source ships a
tokenizer (a trained model), else seeded random ids (random weights have no text to read).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def tokens_for(src: str, n: int, seq_len: int, *, seed: int = 0) -> tuple[torch.Tensor, str]:
    """[windows, seq_len] token ids to compare on, and where they came from."""
    import os

    from beam_model.config import BeamConfig

    if os.path.isfile(os.path.join(src, "tokenizer.json")):
        from beam_model.tokenizer import HFTokenizer
        from workbench.training.corpus import corpus_files, split
        from workbench.training.data import encode_files

        held = split(corpus_files())[1]
        stream = encode_files(HFTokenizer(os.path.join(src, "tokenizer.json")), [f.read() for f in held])
        windows = max(1, min(n, len(stream) - 1) // seq_len)
        return stream.ids[:windows * seq_len].view(windows, seq_len), "held-out standard library files"
    vocab = BeamConfig.from_pretrained(src).vocab_size
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (max(1, n // seq_len), seq_len), generator=g), f"random ids (seed {seed})"


@torch.no_grad()
def compare(source, quantized, windows: torch.Tensor) -> dict:
    """Per-position agreement of two models on `windows` [B, T]."""
    kls, agree = [], 0
    for w in windows:
        p = F.log_softmax(source(w).float(), -1)
        q = F.log_softmax(quantized(w).float(), -1)
        kls.append((p.exp() * (p - q)).sum(-1))
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
    kl = torch.cat(kls).double()
    return {"positions": kl.numel(), "top1_agreement": agree / kl.numel(), "kl_mean": kl.mean().item(),
            "kl_median": kl.median().item(), "kl_p99": torch.quantile(kl, 0.99).item()}
