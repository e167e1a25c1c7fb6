"""`sample:flashinfer`: FlashInfer's sorting-free top-k/top-p sampler behind the `sample` contract.

`flashinfer.sampling.top_k_top_p_sampling_from_probs(probs, top_k, top_p, filter_apply_order=
"top_k_first", generator=...)` draws one id per row from FP32 probabilities: top-k first, then top-p
over the renormalised rest (the contract's order), by rejection sampling in one kernel, with the
Philox seed and offset taken from `generator` (so a generator state reproduces the ids). The
contract's other parts are adapted around it, not relaxed: a grammar's mask sets the tokens it leaves
out to -inf first (beside the kernel, in torch), temperature scales the logits before the
softmax, greedy rows (temperature 0) take the masked logits' argmax, and top_k 0 ("off") becomes the
vocabulary size. Exact ties at the top-k cut are kept together (FlashInfer's pivot), as
`sample:triton` keeps them; the gate's support check allows that.

FlashInfer is imported on the first call: this module must import without it (docs/decisions.md #25).
"""

import torch

from workbench.registry import register
from workbench.variants.sample import mask_logits


@register("sample", "flashinfer", "flashinfer")
def sample_flashinfer(logits, temperature, top_k, top_p, *, generator=None, allowed=None):
    from flashinfer.sampling import top_k_top_p_sampling_from_probs

    logits = mask_logits(logits, allowed)
    vocab = logits.shape[-1]
    probs = (logits.float() / temperature.clamp(min=1e-6)[:, None]).softmax(-1)
    k = torch.where(top_k > 0, top_k, vocab).to(torch.int32)
    ids = top_k_top_p_sampling_from_probs(probs, k, top_p.float(), filter_apply_order="top_k_first",
                                          generator=generator)
    return torch.where(temperature > 0, ids.long(), logits.argmax(-1))
