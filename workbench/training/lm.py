"""The model as a language model under training: logits of whole windows through the reference fusion
points with autograd, and the router's choices recorded as it runs.

A window's tokens go through `BeamForCausalLM.step` over a fresh paged cache (the same model code the
engine runs; the reference variants are differentiable, the cache writes included). The weight
transforms are redone every step (`set_variants`), so each step's graph starts from the parameters.
Routing stays FP32 under BF16 autocast, as the model specifies it.
"""

from __future__ import annotations

import contextlib

import torch

from beam_model.kv_cache import PagedKVCache


def window_logits(model, ids: torch.Tensor, *, cache_dtype: torch.dtype | None = None) -> torch.Tensor:
    """FP32 logits [B * T, vocab] of `ids` [B, T], each row a sequence from position 0."""
    b, t = ids.shape
    cache = PagedKVCache.for_sequences(model.config, [t] * b, dtype=cache_dtype or model.dtype, device=model.device)
    for s in range(b):
        cache.add(s)
    step = cache.prepare_step(list(range(b)), [t] * b)
    return model.step(ids.flatten(), cache, step, all_logits=True).float()


class RouteRecorder:
    """Wraps the bound `route` of `model` (call `attach` after every `set_variants`): each MoE layer's
    expert ids of the last forward, by layer index, and routing in FP32 with autocast off."""

    def __init__(self, model):
        self.model = model
        self.ids: dict[int, torch.Tensor] = {}

    def attach(self) -> None:
        model = self.model
        layer_of = {id(layer.prepared["route"]): layer.index for layer in model.model.layers
                    if "route" in layer.prepared}
        inner = model.ops.route
        self.ids = {}

        def route(x, w, **kw):
            off = torch.autocast(x.device.type, enabled=False) if torch.is_autocast_enabled(x.device.type) \
                else contextlib.nullcontext()
            with off:
                ids, weights = inner(x, w, **kw)
            self.ids[layer_of[id(w)]] = ids.detach()
            return ids, weights

        model.ops.route = route

    def loads(self) -> dict[int, torch.Tensor]:
        """Tokens routed to each expert [experts], per MoE layer, in the last forward."""
        n = self.model.config.n_routed_experts
        return {i: torch.bincount(ids.flatten(), minlength=n) for i, ids in self.ids.items()}
