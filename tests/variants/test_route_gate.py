"""The route gate's FP64 rule (`route.valid_choice`): near-ties pass, real mistakes do not."""

import torch

from workbench.variants.route import TIE_EPS, valid_choice

# 4 groups of 4 experts, 2 groups kept, 3 experts picked
KW = dict(n_group=4, topk_group=2, top_k=3)


def _row(groups):
    return torch.tensor([s for g in groups for s in g], dtype=torch.float64)


def test_unique_choice_accepted_and_other_rejected():
    biased = _row([[0.9, 0.8, 0.1, 0.0], [0.7, 0.6, 0.1, 0.0], [0.3, 0.2, 0.1, 0.0], [0.2, 0.1, 0.0, 0.0]])
    assert valid_choice(biased, [0, 1, 4], **KW)
    assert not valid_choice(biased, [0, 1, 5], **KW)  # skips expert 4 of a kept group
    assert not valid_choice(biased, [0, 1, 8], **KW)  # group 2 is clearly dropped
    assert not valid_choice(biased, [0, 0, 1], **KW)  # not top_k distinct experts


def test_tied_group_left_unpicked():
    """Groups 1 and 2 tie for the second kept slot. Both picks below keep group 0 only: keeping group 2
    they are right (its best expert 0.59 loses to 0.6), keeping group 1 expert 4 (0.64) would win.
    The old rule filled the slot with the FP64-best rest (group 1) and rejected the first pick."""
    half = TIE_EPS / 4
    biased = _row([[0.9, 0.8, 0.6, 0.0], [0.64, 0.5, 0.0, 0.0], [0.55, 0.59 - half, 0.0, 0.0],
                   [0.1, 0.0, 0.0, 0.0]])
    assert biased[4:6].sum() > biased[8:10].sum()  # group 1 is FP64's own choice
    assert valid_choice(biased, [0, 1, 2], **KW)  # right if group 2 is kept: a tie, accepted
    assert valid_choice(biased, [0, 1, 4], **KW)  # FP64's choice
    # The same pick without the tie is wrong: group 1 must be kept, and its 0.64 beats 0.6
    biased[9] = 0.4
    assert not valid_choice(biased, [0, 1, 2], **KW)
