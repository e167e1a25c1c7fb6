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
`boundary`, `dense_mlp`, `head`) and the block attention through its own (`draft_attention`). The mask
positions' logits come from the target's LM head (shared, frozen) after the drafter's own final norm;
the token embedding is the target's too, the mask a learned vector of the drafter's own (Beam's
vocabulary has no mask token).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
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
        starts - C .. starts - 1 (right-aligned; `valid` [S, C]: which exist): a page of the window per
        block, then a page per block for its own keys."""
        s, c_len, _ = context.shape
        dev, page_size = context.device, max(c_len, self.config.block_size)
        positions = (starts[:, None] - c_len + torch.arange(c_len, device=dev)).clamp(min=0)
        store = self.context_store(2 * s, page_size)
        window = torch.arange(c_len, device=dev).expand(s, c_len)
        slots = (torch.arange(s, device=dev)[:, None] * page_size + window).reshape(-1)
        self.write_context(context.reshape(s * c_len, -1).to(self.dtype), positions.reshape(-1), slots, store)
        pages = torch.arange(s, device=dev)[:, None].expand(s, c_len)
        return ContextKV(store, pages, window, valid, s + torch.arange(s, device=dev))

    def block_logits(self, first_ids: torch.Tensor, starts: torch.Tensor, context: "ContextKV",
                     block_size: int | None = None, fed: tuple | None = None) -> torch.Tensor:
        """FP32 logits [S, B - 1, vocab] of the mask positions of S blocks.

        first_ids [S]: each block's first token (the last accepted one), at position starts[s];
        context: where each block finds the keys and values of the C positions before it, and the page
        its own go to; fed: (features [N, hidden], positions [N], slots [N]) of context positions whose
        keys each layer writes first (`write_context`'s, in the layer's projection of the block rows:
        one call where a step both computes positions and drafts after them)."""
        cfg = self.config
        b = block_size or cfg.block_size
        s, h_dim, dev = first_ids.shape[0], cfg.hidden_size, first_ids.device
        page_size = context.store[0].shape[2]
        if b > page_size:
            raise ValueError(f"a block of {b} does not fit a page of the drafter's store ({page_size})")
        emb = self.target.embed(first_ids).to(self.dtype)
        h = torch.cat([emb[:, None, :], self.mask_embedding.to(self.dtype).expand(s, b - 1, h_dim)], 1)
        h = h.reshape(s * b, h_dim)
        # the block's own keys: its page, at positions starts .. starts + B - 1; fed rows' first
        offsets = torch.arange(b, device=dev).expand(s, b)
        slots = (context.block_pages[:, None] * page_size + offsets).reshape(-1)
        positions = (starts[:, None] + offsets).reshape(-1)
        features = None
        if fed is not None:
            features, fed_positions, fed_slots = fed
            slots, positions = torch.cat([fed_slots, slots]), torch.cat([fed_positions, positions])
        # what each block attends: its context where it exists, then its whole block; made once for every layer,
        # the pages clamped (a page not held reads page 0, masked) and the mask additive, as SDPA makes a boolean one
        pages = torch.cat([context.pages, context.block_pages[:, None].expand(s, b)], 1).clamp(min=0)
        keys_at = (pages, torch.cat([context.offsets, offsets], 1))
        valid = torch.cat([context.valid, torch.ones(s, b, dtype=torch.bool, device=dev)], 1)
        mask = torch.zeros(valid.shape, dtype=self.dtype, device=dev).masked_fill_(~valid, float("-inf"))
        x = rms_norm(h, self.layers[0].input_layernorm.weight, cfg.rms_norm_eps).to(self.dtype)
        for layer, store in zip(self.layers, context.store):
            y = self._attention(layer, x, features, store, (slots, positions), keys_at, mask)
            h, x = self.ops.boundary(y, h, layer.prepared["boundary_attn"], eps=cfg.rms_norm_eps)
            y = self.ops.dense_mlp(x, layer.prepared["dense_mlp"])
            h, x = self.ops.boundary(y, h, layer.prepared["boundary_mlp"], eps=cfg.rms_norm_eps)
        masks = h.view(s, b, h_dim)[:, 1:].reshape(s * (b - 1), h_dim)
        head = {"norm": self.norm.weight, "lm_head": self.target.lm_head.weight}
        logits = self.ops.head(masks, head, eps=cfg.rms_norm_eps, softcap=cfg.final_logit_softcapping)
        return logits.float().view(s, b - 1, -1)

    def _attention(self, layer: DraftLayer, x, features, store, written_at, keys_at, mask):
        """A layer's block attention: `qkvg_proj` over [the fed context rows (their queries and gates go
        unused); the block rows], `qk_prep` (head norms, RoPE at each row's position, the keys and
        values into `store` at `written_at`'s slots), one attention call from the block to the keys and
        values at `keys_at` (pages, clamped, and offsets [S, C + B]) under the additive `mask` [S, C + B]
        (-inf where a key does not exist: `draft_attention`), `attn_out`."""
        cfg = self.config
        n = 0 if features is None else features.shape[0]
        rows = x if features is None else torch.cat([features, x])
        q, k, v, g = self.ops.qkvg_proj(rows, layer.prepared["qkvg_proj"])
        slots, positions = written_at
        q = self.ops.qk_prep(q, k, v, layer.prepared["qk_prep"], cache=store, slot_mapping=slots,
                             positions=positions, eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta)[n:]
        out = self.ops.draft_attention(q, store, keys_at[0], keys_at[1], mask)
        return self.ops.attn_out(out, g[n:], layer.prepared["attn_out"])


@dataclass
class ContextKV:
    """Where S blocks find the keys and values of their context (positions starts - C .. starts - 1):
    per draft layer a store of pages [pages, 2, page_size, kv_heads, head_dim] (`write_context` fills
    it), and per block the page and the offset of each context position and whether it exists, and the
    page its own block's keys go to. In the engine the store's pages are the target's sliding-window
    pages, so a sequence's page table finds them, and a page per block past them."""
    store: list[torch.Tensor]
    pages: torch.Tensor        # [S, C] int64
    offsets: torch.Tensor      # [S, C] int64
    valid: torch.Tensor        # [S, C] bool
    block_pages: torch.Tensor  # [S] int64

    @classmethod
    def from_page_table(cls, store: list[torch.Tensor], tables: torch.Tensor, starts: torch.Tensor, window: int,
                        block_pages: torch.Tensor) -> "ContextKV":
        """Blocks at `starts` [S] reading the `window` positions before them through their sequences' page
        tables [S, pages] (-1: a page the sequence no longer holds): a position exists if it is not
        negative and its page is held. Host-free, so a CUDA graph captures it."""
        page_size = store[0].shape[2]
        at = starts[:, None] - window + torch.arange(window, device=starts.device)[None, :]
        index = (at.clamp(min=0) // page_size).clamp(max=tables.shape[1] - 1)
        pages = tables.gather(1, index).long()
        return cls(store, pages, at.clamp(min=0) % page_size, (at >= 0) & (pages >= 0), block_pages)
