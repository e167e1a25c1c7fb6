"""The DFlash block drafter: one forward pass proposes a block of tokens after the last accepted one.

Its input is a block [last accepted token, mask, ..., mask] at positions p .. p + B - 1 and its context:
the target's hidden states at a few of its layers (`DrafterConfig.target_layer_ids`) for the positions
before p, concatenated, projected (`fc`) and normalised (`hidden_norm`): one feature vector per
position. Every draft layer attends from the block to [its own K/V of the context features; the
block's K/V], non-causally inside the block, the context limited to the layer's window. A context
position's K/V depend on its feature alone, so they are written once, when the target computes the
position (`write_context`), to pages a block finds through `ContextKV`: in the engine the target's
sliding-window pages, in training a page per window that every block of the window reads. The layers
are Beam's sliding-window layers with a dense MLP (gated attention, sandwich norms, depth-scaled
residuals) and run through the same fusion points as the target (`qkvg_proj`, `qk_prep`, `attn_out`,
`boundary`, `dense_mlp`, `head`); the block attention itself is one PyTorch attention call. The mask
positions' logits come from the target's LM head (shared, frozen) after the drafter's own final norm;
the token embedding is the target's too, the mask a learned vector of the drafter's own (Beam's
vocabulary has no mask token).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from beam_model.drafter_config import DrafterConfig
from beam_model.functional import linear, rms_norm
from beam_model.model import Attention, DenseMLP, Linear, Norm, _param, prepared_layer
from workbench.registry import bind

WEIGHTS_FILE = "model.safetensors"


class DraftLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = Norm(c.hidden_size)
        self.post_attention_layernorm = Norm(c.hidden_size)
        self.pre_feedforward_layernorm = Norm(c.hidden_size)
        self.post_feedforward_layernorm = Norm(c.hidden_size)
        self.self_attn = Attention(c)
        self.mlp = DenseMLP(c)
        self.prepared: dict = {}


class BeamDrafter(nn.Module):
    def __init__(self, config: DrafterConfig, dtype=torch.bfloat16):
        super().__init__()
        self.config, self.dtype = config, dtype
        c = config.layer_config()
        with torch.device("meta"):
            self.fc = Linear(config.hidden_size, config.feature_width)
            self.hidden_norm = Norm(config.hidden_size)
            self.mask_embedding = _param(config.hidden_size)
            self.layers = nn.ModuleList(DraftLayer(c) for _ in range(config.num_hidden_layers))
            self.norm = Norm(config.hidden_size)
        for p in self.parameters():
            p.data = torch.empty(p.shape, device="meta", dtype=dtype)
        self._shared: list = []  # the target whose embedding and LM head it shares (`attach`); not a submodule
        self.ops = None

    # ---- construction ---------------------------------------------------------------------------
    def attach(self, target) -> None:
        """Share `target`'s embedding and LM head; ValueError if the drafter was made for another model."""
        self.config.check_target(target.config)
        self._shared = [target]

    @property
    def target(self):
        """The target model it drafts for (its weights are the target's, never the drafter's)."""
        return self._shared[0] if self._shared else None

    @classmethod
    def from_pretrained(cls, path: str, target, *, dtype=None, device=None, variants=None) -> "BeamDrafter":
        """A drafter folder for `target` (its dtype and device unless given)."""
        from beam_model.weights import checked_files, materialize, read_into

        drafter = cls(DrafterConfig.from_pretrained(path), dtype or target.dtype)
        drafter.attach(target)
        device = torch.device(device) if device is not None else target.device
        expected = {n: tuple(p.shape) for n, p in drafter.named_parameters()}
        files = checked_files(path, expected, what="drafter checkpoint")
        read_into(materialize(drafter, device), files, device)
        drafter.set_variants(variants)
        return drafter

    def save_pretrained(self, path: str) -> None:
        from safetensors.torch import save_file

        self.config.save_pretrained(path)
        save_file({n: p.detach().contiguous().cpu() for n, p in self.named_parameters()},
                  os.path.join(path, WEIGHTS_FILE))

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def set_variants(self, selection: dict[str, str] | None = None, configs: dict | None = None) -> None:
        """Bind the fusion points' variants and prepare each layer's weights (as the target does)."""
        self.use_ops(bind(selection, configs))

    def use_ops(self, ops) -> None:
        """Run the points through `ops`, bound variants (the target's own, say: a profiler that wraps the
        target's points then sees the drafter's calls too), each layer's weights prepared for them."""
        self.ops = ops
        for i, layer in enumerate(self.layers):
            layer.prepared = prepared_layer(ops, self.layers, i)

    # ---- compute --------------------------------------------------------------------------------
    def context_features(self, tapped: torch.Tensor) -> torch.Tensor:
        """The target's tapped hidden states [N, feature_width] -> context features [N, hidden]."""
        x = linear(tapped.to(self.dtype), self.fc.weight)
        return rms_norm(x, self.hidden_norm.weight, self.config.rms_norm_eps).to(self.dtype)

    def context_store(self, pages: int, page_size: int) -> list[torch.Tensor]:
        """Empty pages for the context's keys and values, one store per draft layer, each
        [pages, 2, page_size, kv_heads, head_dim] (the paged KV cache's layout; zeros, so that a masked-
        out key never holds a NaN that the attention's weighted sum would spread)."""
        c = self.config
        return [torch.zeros(pages, 2, page_size, c.num_key_value_heads, c.head_dim, dtype=self.dtype,
                            device=self.device) for _ in self.layers]

    def page_bytes(self, page_size: int) -> int:
        """What `context_store` holds per page."""
        c = self.config
        return len(self.layers) * 2 * page_size * c.num_key_value_heads * c.head_dim * self.dtype.itemsize

    def write_context(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      store: list[torch.Tensor]) -> None:
        """Every draft layer's keys and values of context features [N, hidden] at `positions` [N], into
        `store` at `slots` [N] (page * page_size + offset). A context position's keys depend on its
        feature alone, so they are written once, when the target computes the position."""
        cfg = self.config
        for layer, pages in zip(self.layers, store):
            q, k, v, _ = self.ops.qkvg_proj(features, layer.prepared["qkvg_proj"])  # the queries go unused
            self.ops.qk_prep(q, k, v, layer.prepared["qk_prep"], cache=pages, slot_mapping=slots,
                             positions=positions, eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta)

    def context_kv(self, starts: torch.Tensor, context: torch.Tensor, valid: torch.Tensor) -> "ContextKV":
        """The ContextKV of S blocks at `starts` [S] from their context features [S, C, hidden] of positions
        starts - C .. starts - 1 (right-aligned; `valid` [S, C]: which exist): a page of C per block."""
        s, c_len, _ = context.shape
        positions = (starts[:, None] - c_len + torch.arange(c_len, device=context.device)).clamp(min=0)
        store = self.context_store(s, c_len)
        slots = torch.arange(s * c_len, device=context.device)
        self.write_context(context.reshape(s * c_len, -1).to(self.dtype), positions.reshape(-1), slots, store)
        pages = torch.arange(s, device=context.device)[:, None].expand(s, c_len)
        return ContextKV(store, pages, torch.arange(c_len, device=context.device).expand(s, c_len), valid)

    def block_logits(self, first_ids: torch.Tensor, starts: torch.Tensor, context: "ContextKV",
                     block_size: int | None = None) -> torch.Tensor:
        """FP32 logits [S, B - 1, vocab] of the mask positions of S blocks.

        first_ids [S]: each block's first token (the last accepted one), at position starts[s];
        context: where each block finds the keys and values of the C positions before it."""
        cfg = self.config
        b = block_size or cfg.block_size
        s, h_dim, dev = first_ids.shape[0], cfg.hidden_size, first_ids.device
        emb = self.target.embed(first_ids).to(self.dtype)
        h = torch.cat([emb[:, None, :], self.mask_embedding.to(self.dtype).expand(s, b - 1, h_dim)], 1)
        h = h.reshape(s * b, h_dim)
        # the block's own keys and values: a page of B per block, at positions starts .. starts + B - 1
        block_at = (torch.arange(s * b, device=dev), (starts[:, None] + torch.arange(b, device=dev)).reshape(-1))
        x = rms_norm(h, self.layers[0].input_layernorm.weight, cfg.rms_norm_eps).to(self.dtype)
        for i, layer in enumerate(self.layers):
            y = self._attention(layer, x, context.keys_values(i), context.valid, block_at, s, b)
            h, x = self.ops.boundary(y, h, layer.prepared["boundary_attn"], eps=cfg.rms_norm_eps)
            y = self.ops.dense_mlp(x, layer.prepared["dense_mlp"])
            h, x = self.ops.boundary(y, h, layer.prepared["boundary_mlp"], eps=cfg.rms_norm_eps)
        masks = h.view(s, b, h_dim)[:, 1:].reshape(s * (b - 1), h_dim)
        head = {"norm": self.norm.weight, "lm_head": self.target.lm_head.weight}
        logits = self.ops.head(masks, head, eps=cfg.rms_norm_eps, softcap=cfg.final_logit_softcapping)
        return logits.float().view(s, b - 1, -1)

    def _attention(self, layer: DraftLayer, x, context_kv, context_valid, block_at, s: int, b: int):
        """A layer's block attention: `qkvg_proj` over the block rows, `qk_prep` (head norms, RoPE at each
        row's position, the block's keys and values into a page of its own), one attention call from the
        block to [the context's keys and values where valid; the block's], `attn_out`."""
        cfg = self.config
        heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q, k, v, g = self.ops.qkvg_proj(x, layer.prepared["qkvg_proj"])
        # the block's pages: autograd keeps each layer's keys for the backward pass
        cache = torch.empty(s, 2, b, kv_heads, d, dtype=self.dtype, device=x.device)
        slots, positions = block_at
        q = self.ops.qk_prep(q, k, v, layer.prepared["qk_prep"], cache=cache, slot_mapping=slots,
                             positions=positions, eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta)
        ctx_k, ctx_v = context_kv
        keys = torch.cat([ctx_k.to(cache.dtype), cache[:, 0]], 1).transpose(1, 2)   # [S, kv_heads, C + B, d]
        values = torch.cat([ctx_v.to(cache.dtype), cache[:, 1]], 1).transpose(1, 2)
        valid = torch.cat([context_valid, torch.ones(s, b, dtype=torch.bool, device=x.device)], 1)
        # Every block position sees the same keys, so the query heads that share a kv head are one longer
        # query sequence [S, kv_heads, rep * B, d]: one attention call, no repeated keys or values
        rep = heads // kv_heads
        q = q.reshape(s, b, kv_heads, rep, d).permute(0, 2, 3, 1, 4).reshape(s, kv_heads, rep * b, d)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=valid[:, None, None, :])
        out = out.view(s, kv_heads, rep, b, d).permute(0, 3, 1, 2, 4).reshape(s * b, heads, d)
        return self.ops.attn_out(out, g, layer.prepared["attn_out"])


@dataclass
class ContextKV:
    """Where S blocks find the keys and values of their context (positions starts - C .. starts - 1):
    per draft layer a store of pages [pages, 2, page_size, kv_heads, head_dim] (`write_context` fills
    it), and per block the page and the offset of each context position, and whether it exists. In the
    engine the store's pages are the target's sliding-window pages, so a sequence's page table finds them."""
    store: list[torch.Tensor]
    pages: torch.Tensor    # [S, C] int64
    offsets: torch.Tensor  # [S, C] int64
    valid: torch.Tensor    # [S, C] bool

    @classmethod
    def from_page_table(cls, store: list[torch.Tensor], tables: torch.Tensor, starts: torch.Tensor, window: int,
                        page_size: int) -> "ContextKV":
        """Blocks at `starts` [S] reading the `window` positions before them through their sequences' page
        tables [S, pages] (-1: a page the sequence no longer holds): a position exists if it is not
        negative and its page is held. Host-free, so a CUDA graph captures it."""
        at = starts[:, None] - window + torch.arange(window, device=starts.device)[None, :]
        index = (at.clamp(min=0) // page_size).clamp(max=tables.shape[1] - 1)
        pages = tables.gather(1, index).long()
        return cls(store, pages, at.clamp(min=0) % page_size, (at >= 0) & (pages >= 0))

    def keys_values(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s context keys and values, each [S, C, kv_heads, head_dim]."""
        pages = self.store[layer]
        at = self.pages.clamp(min=0), self.offsets  # a page the table lacks (-1) is masked out
        return pages[at[0], 0, at[1]], pages[at[0], 1, at[1]]
