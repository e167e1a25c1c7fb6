"""A minimal generation loop over the paged KV cache: prefill every prompt, then batched decode.

This is the reference way to drive `BeamForCausalLM.step`; the server's engine does the same with
continuous batching. It never captures graphs or picks variants: the model comes bound.
"""

from __future__ import annotations

import torch

from beam_model.kv_cache import PagedKVCache


@torch.inference_mode()
def generate(model, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, stop_ids: tuple[int, ...] = (),
             vocab_limit: int | None = None) -> list[list[int]]:
    """Continue each prompt by up to max_new_tokens tokens; a sequence stops at any of stop_ids. Only ids
    below `vocab_limit` are drawn (a tokenizer's vocabulary, where the model's is padded past it)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    vocab = model.config.vocab_size
    bad = [t for p in prompts for t in p if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary (size {vocab})")
    device = model.device
    cache = PagedKVCache.for_sequences(model.config, [len(p) + max_new_tokens for p in prompts],
                                       dtype=model.dtype, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    outputs: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    for s in active:
        cache.add(s)
    tokens = [list(p) for p in prompts]  # what each active sequence feeds this step
    while active and max_new_tokens > 0:
        step = cache.prepare_step(active, [len(tokens[s]) for s in active])
        ids = torch.tensor([t for s in active for t in tokens[s]], device=device)
        logits = model.step(ids, cache, step)
        if vocab_limit is not None and vocab_limit < logits.shape[-1]:
            logits = logits[:, :vocab_limit].contiguous()
        n = len(active)
        params = dict(temperature=torch.full((n,), float(temperature), device=device),
                      top_k=torch.full((n,), int(top_k), device=device),
                      top_p=torch.full((n,), float(top_p), device=device))
        chosen = model.ops.sample(logits, **params, generator=generator).tolist()
        still = []
        for s, t in zip(active, chosen):
            outputs[s].append(t)
            tokens[s] = [t]
            if t in stop_ids or len(outputs[s]) >= max_new_tokens:
                cache.free(s)
            else:
                still.append(s)
        active = still
    return outputs
