"""The sampled half of a fused verify + draft step (`verify_draft`): the distributions, draws and acceptance
of blocks of drafts, with no host sync, so a CUDA graph captures them.

Each function runs Triton kernels on a GPU (one launch each: `kernels.sample_probs`,
`kernels.rejection_sampling`) and the same math in torch elsewhere (`*_torch`, what the CPU's engine runs and
the kernels are tested against). Draws are exponential races, argmax p / noise with `noise` Exp(1) from the
engine's generator: a draw with probability p, whichever runs it.
"""

from __future__ import annotations

import torch

from workbench.variants.kernels.rejection_sampling import accept_block
from workbench.variants.kernels.sample_probs import sample_probs
from workbench.variants.kernels.triton_common import triton
from workbench.variants.sample import contract_probs


def _kernels(t: torch.Tensor) -> bool:
    return t.is_cuda and triton is not None


def target_probs(logits, temperature, top_k, top_p):
    """FP64 probabilities [rows, vocab] of the `sample` contract's distribution of each row."""
    if _kernels(logits):
        return sample_probs(logits, temperature, top_k, top_p)
    return contract_probs(logits, temperature, top_k, top_p)


def draft_draws(logits, temperature, top_k, top_p, noise):
    """(probabilities [rows, vocab] FP64, a draft a row [rows], its probability [rows]): sampled rows draw from
    their distribution; a greedy row (temperature 0) takes its argmax, with the softmax's probability of it
    at temperature 1 (the drafter's confidence)."""
    if _kernels(logits):
        return sample_probs(logits, temperature, top_k, top_p, noise=noise)
    return draft_draws_torch(logits, temperature, top_k, top_p, noise)


def draft_draws_torch(logits, temperature, top_k, top_p, noise):
    probs = contract_probs(logits, temperature, top_k, top_p)
    greedy = temperature <= 0
    ids = torch.where(greedy, logits.argmax(-1), race(probs, noise))
    chosen = torch.where(greedy[:, None], logits.softmax(-1).to(probs.dtype), probs)
    return probs, ids, chosen.gather(1, ids[:, None])[:, 0]


def accept_drafts(p, q, drafts, u, limit, noise, greedy, kept_greedy, bonus_greedy):
    """(kept [b], bonus [b]) of each sequence's block (`rejection_sampling.accept_block`'s contract)."""
    if _kernels(p):
        return accept_block(p, q, drafts, u, limit, noise, greedy, kept_greedy, bonus_greedy)
    return accept_drafts_torch(p, q, drafts, u, limit, noise, greedy, kept_greedy, bonus_greedy)


def accept_drafts_torch(p, q, drafts, u, limit, noise, greedy, kept_greedy, bonus_greedy):
    b, k1, vocab = p.shape
    k = k1 - 1
    p_d, q_d = (t[:, :k].gather(2, drafts[..., None])[..., 0] for t in (p, q))
    kept = torch.minimum(((q_d > 0) & (u * q_d <= p_d)).long().cumprod(1).sum(1), limit)
    at = kept[:, None, None].expand(b, 1, vocab)
    p_at = p.gather(1, at)[:, 0]
    q_at = torch.cat([q, q.new_zeros(b, 1, vocab)], 1).gather(1, at)[:, 0] * (kept < limit)[:, None]
    residual = (p_at - q_at).clamp(min=0)  # after a rejection; p itself after the last keepable draft
    dist = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)
    return torch.where(greedy, kept_greedy, kept), torch.where(greedy, bonus_greedy, race(dist, noise))


def race(probs, noise):
    """argmax probs / noise over the last dim: a draw with probability proportional to probs."""
    return (probs / noise.clamp(min=1e-30)).argmax(-1)
