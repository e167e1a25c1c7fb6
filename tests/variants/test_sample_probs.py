"""`sample_probs` (the `sample` contract's distribution without a sort, what the fused verify + draft step
reads) against the contract's FP64 reference `contract_probs`; with its draws, and `accept_block`, against
the torch the CPU's engine runs (`server.engine.block_sampling`).

CPU: the Triton interpreter at a vocabulary of 300 (several chunks of 128, a masked tail).
GPU (`-m gpu`): beam-mini's vocabulary at a verify step's 16 rows.
"""

import pytest
import torch

from workbench.variants.sample import MIXES, contract_probs

pytest.importorskip("triton")

from server.engine.block_sampling import accept_drafts_torch, draft_draws_torch  # noqa: E402
from workbench.variants.kernels.rejection_sampling import accept_block  # noqa: E402
from workbench.variants.kernels.sample_probs import sample_probs  # noqa: E402

# The gate's mixes, then the edges: top-k 1, top-p 0 (the maximum alone), top-k V - 1 and V, a greedy row
# at a low temperature, and a cold row.
ROWS = MIXES + [(0.5, 1, 1.0), (1.0, 0, 0.0), (1.0, 299, 0.5), (1.0, 300, 0.99), (0.05, 0, 0.9)]


def _settings(rows, device="cpu"):
    return (torch.tensor([r[0] for r in rows], device=device), torch.tensor([r[1] for r in rows], device=device),
            torch.tensor([r[2] for r in rows], device=device))


def test_rows_match_the_contracts_distribution():
    logits = torch.randn(len(ROWS), 300, generator=torch.Generator().manual_seed(0)) * 5
    settings = _settings(ROWS)
    got, want = sample_probs(logits, *settings, block=128), contract_probs(logits, *settings)
    assert got.dtype == torch.float64
    assert torch.equal(got > 0, want > 0)  # the same tokens kept, row by row
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got.sum(-1), torch.ones(len(ROWS), dtype=torch.float64))


def test_ties_at_the_top_k_cut_are_kept_together():
    """Tokens tied exactly at the k-th value all stay, sharing its mass (the reference keeps k of them)."""
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0, -1.0]])
    got = sample_probs(logits, *_settings([(1.0, 2, 1.0)]), dtype=torch.float32, block=4)
    want = torch.tensor([3.0, 2.0, 2.0, 2.0]).softmax(0)
    torch.testing.assert_close(got[0, [0, 2, 3, 4]], want)
    assert got[0, [1, 5, 6]].eq(0).all()


def test_top_p_keeps_the_tokens_whose_mass_above_is_within_p():
    """Probabilities .5, .3, .2: the second token stays once p reaches the .5 above it, the third at .8."""
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    for p, kept in ((0.45, [True, False, False]), (0.55, [True, True, False]), (0.85, [True, True, True])):
        got = sample_probs(logits, *_settings([(1.0, 0, p)]))
        assert (got[0] > 0).tolist() == kept, p
        assert (contract_probs(logits, *_settings([(1.0, 0, p)]))[0] > 0).tolist() == kept, p


def test_draws_are_the_races_the_engine_runs_in_torch():
    """The same noise gives the same tokens: sampled rows race their probabilities, greedy rows take the
    argmax with the temperature-1 softmax's probability."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(len(ROWS), 300, generator=gen) * 5
    settings = _settings(ROWS)
    noise = torch.empty(len(ROWS), 300, dtype=torch.float64).exponential_(generator=gen)
    probs, ids, chosen = sample_probs(logits, *settings, noise=noise, block=128)
    want_probs, want_ids, want_chosen = draft_draws_torch(logits, *settings, noise)
    torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=1e-7)
    assert ids.tolist() == want_ids.tolist()
    torch.testing.assert_close(chosen, want_chosen, rtol=1e-5, atol=1e-7)


def _block(b, k, vocab, gen):
    """Distributions of b blocks of k drafts over `vocab`, the drafter's close to the target's so that
    drafts are often kept, drafts drawn from them."""
    p = (torch.randn(b, k + 1, vocab, generator=gen) * 2).softmax(-1).double()
    q = (p[:, :k].log() + 0.5 * torch.randn(b, k, vocab, generator=gen, dtype=torch.float64)).softmax(-1)
    drafts = torch.multinomial(q.view(b * k, vocab).float(), 1, generator=gen).view(b, k)
    return p, q, drafts


def test_acceptance_matches_the_engines_torch():
    """Every sequence's kept count and bonus token as the torch acceptance gives them from the same draws:
    blocks kept whole and rejected at each position, limits below K (padding rows), greedy rows, and a
    rejection whose residual is empty (q = p there: the bonus comes from p)."""
    gen = torch.Generator().manual_seed(2)
    b, k, vocab = 32, 4, 300
    p, q, drafts = _block(b, k, vocab, gen)
    q[0, 0] = p[0, 0]  # its residual is empty
    u = torch.rand(b, k, generator=gen, dtype=torch.float64)
    u[0, 0] = 2.0  # rejected at the first draft
    limit = torch.tensor([k, k, 2, 0] * (b // 4))
    noise = torch.empty(b, vocab, dtype=torch.float64).exponential_(generator=gen)
    greedy = torch.arange(b) % 5 == 4
    kept_g, bonus_g = torch.randint(0, k + 1, (b,), generator=gen), torch.randint(0, vocab, (b,), generator=gen)
    args = (p, q, drafts, u, limit, noise, greedy, kept_g, bonus_g)
    kept, bonus = accept_block(*args, block=128)
    want_kept, want_bonus = accept_drafts_torch(*args)
    assert kept.tolist() == want_kept.tolist() and bonus.tolist() == want_bonus.tolist()
    sampled = ~greedy
    assert {0, 1, 2, k} <= set(kept[sampled].tolist())  # the cases the docstring names occur
    assert kept[0] == 0 and (kept[sampled] == limit[sampled]).any()


def test_a_block_of_one_row_draws_from_the_target():
    """No drafts (a block of the pending token alone): nothing to keep, the bonus is drawn from p."""
    gen = torch.Generator().manual_seed(3)
    p, _, _ = _block(3, 0, 50, gen)
    noise = torch.empty(3, 50, dtype=torch.float64).exponential_(generator=gen)
    zeros = torch.zeros(3, dtype=torch.int64)
    kept, bonus = accept_block(p, p[:, :0], zeros[:, None][:, :0], torch.zeros(3, 0, dtype=torch.float64), zeros,
                               noise, zeros.bool(), zeros, zeros)
    assert kept.tolist() == [0, 0, 0] and bonus.tolist() == (p[:, 0] / noise).argmax(-1).tolist()


@pytest.mark.gpu
def test_a_verify_steps_rows_on_the_gpu():
    rows = [ROWS[i % len(ROWS)] for i in range(16)]
    rows = [(t, min(k, 8192), p) for t, k, p in rows]
    logits = torch.randn(16, 8192, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 3
    settings = _settings(rows, "cuda")
    got, want = sample_probs(logits, *settings), contract_probs(logits, *settings)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
