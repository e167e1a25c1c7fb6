"""The DFlash block drafter: one forward pass proposes a block of tokens after the last accepted one.

Its input is a block [last accepted token, mask, ..., mask] at positions p .. p + B - 1 and its context:
the target's hidden states at a few of its layers (`DrafterConfig.target_layer_ids`) for the positions
before p, concatenated, projected (`fc`) and normalised (`hidden_norm`): one feature vector per
position. Every draft layer attends from the block to [its own K/V of the context features; the
block's K/V], non-causally inside the block, the context limited to the layer's window. The layers
are Beam's sliding-window layers with a dense MLP (gated attention, sandwich norms, depth-scaled
residuals) and run through the same fusion points as the target (`qkvg_proj`, `qk_prep`, `attn_out`,
`boundary`, `dense_mlp`, `head`); the block attention itself is one PyTorch attention call. The mask
positions' logits come from the target's LM head (shared, frozen) after the drafter's own final norm;
the token embedding is the target's too, the mask a learned vector of the drafter's own (Beam's
vocabulary has no mask token).
"""

from __future__ import annotations

import os

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

    def block_logits(self, first_ids: torch.Tensor, starts: torch.Tensor, context: torch.Tensor,
                     context_valid: torch.Tensor, block_size: int | None = None) -> torch.Tensor:
        """FP32 logits [S, B - 1, vocab] of the mask positions of S blocks.

        first_ids [S]: each block's first token (the last accepted one), at position starts[s];
        context [S, C, hidden]: context features of positions starts[s] - C .. starts[s] - 1 (right-
        aligned); context_valid [S, C] bool: which of those exist (a sequence shorter than C)."""
        cfg = self.config
        b = block_size or cfg.block_size
        s, c_len = context.shape[:2]
        h_dim, dev, span = cfg.hidden_size, context.device, c_len + b
        emb = self.target.embed(first_ids).to(self.dtype)
        h = torch.cat([emb[:, None, :], self.mask_embedding.to(self.dtype).expand(s, b - 1, h_dim)], 1)
        h = h.reshape(s * b, h_dim)
        # A layer projects every context row, then every block row; their keys and values go to one page
        # per sequence, context then block, at positions starts - C .. starts + B - 1
        offsets = torch.arange(span, device=dev)
        slots = torch.arange(s, device=dev)[:, None] * span + offsets[None, :]
        positions = (starts[:, None] - c_len + offsets[None, :]).clamp(min=0)
        keys_at = (torch.cat([slots[:, :c_len].reshape(-1), slots[:, c_len:].reshape(-1)]),
                   torch.cat([positions[:, :c_len].reshape(-1), positions[:, c_len:].reshape(-1)]))
        # keys: the context (where valid) then the whole block, seen by every block position
        valid = torch.cat([context_valid, torch.ones(s, b, dtype=torch.bool, device=dev)], 1)
        ctx = context.reshape(s * c_len, h_dim).to(self.dtype)
        x = rms_norm(h, self.layers[0].input_layernorm.weight, cfg.rms_norm_eps).to(self.dtype)
        for layer in self.layers:
            y = self._attention(layer, x, ctx, keys_at, valid, s, b)
            h, x = self.ops.boundary(y, h, layer.prepared["boundary_attn"], eps=cfg.rms_norm_eps)
            y = self.ops.dense_mlp(x, layer.prepared["dense_mlp"])
            h, x = self.ops.boundary(y, h, layer.prepared["boundary_mlp"], eps=cfg.rms_norm_eps)
        masks = h.view(s, b, h_dim)[:, 1:].reshape(s * (b - 1), h_dim)
        head = {"norm": self.norm.weight, "lm_head": self.target.lm_head.weight}
        logits = self.ops.head(masks, head, eps=cfg.rms_norm_eps, softcap=cfg.final_logit_softcapping)
        return logits.float().view(s, b - 1, -1)

    def _attention(self, layer: DraftLayer, x, ctx, keys_at, valid, s: int, b: int):
        """A layer's block attention: `qkvg_proj` over the context rows and the block rows (the context's
        queries and gates go unused), `qk_prep` (head norms, RoPE at each row's position, the keys and
        values into this layer's pages), one attention call, `attn_out`."""
        cfg = self.config
        heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        span, n_ctx = valid.shape[1], ctx.shape[0]
        q, k, v, g = self.ops.qkvg_proj(torch.cat([ctx, x]), layer.prepared["qkvg_proj"])
        # a layer's own pages: autograd keeps each layer's keys for the backward pass
        cache = torch.empty(s, 2, span, kv_heads, d, dtype=self.dtype, device=x.device)
        slots, positions = keys_at
        q = self.ops.qk_prep(q, k, v, layer.prepared["qk_prep"], cache=cache, slot_mapping=slots,
                             positions=positions, eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta)[n_ctx:]
        keys, values = cache[:, 0].transpose(1, 2), cache[:, 1].transpose(1, 2)  # [S, kv_heads, C + B, d]
        # Every block position sees the same keys, so the query heads that share a kv head are one longer
        # query sequence [S, kv_heads, rep * B, d]: one attention call, no repeated keys or values
        rep = heads // kv_heads
        q = q.reshape(s, b, kv_heads, rep, d).permute(0, 2, 3, 1, 4).reshape(s, kv_heads, rep * b, d)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=valid[:, None, None, :])
        out = out.view(s, kv_heads, rep, b, d).permute(0, 3, 1, 2, 4).reshape(s * b, heads, d)
        return self.ops.attn_out(out, g[n_ctx:], layer.prepared["attn_out"])
