"""The Beam decoder, top to bottom, written against fusion points.

Every hot operation is a call `ops.<point>(...)` on the bound variant table from
`workbench.registry`; which implementation runs is chosen by `set_variants`, never here. Parameter
names follow the checkpoint's tensor names, except that each MoE layer keeps its experts stacked
(`mlp.experts.gate_proj` is [experts, ff, hidden]; `weights.py` maps to per-expert names).

One step = embed -> first pre-norm -> 52 x (attention sub-layer, boundary, MLP sub-layer, boundary)
-> head. Attention always goes through the paged KV cache; `forward(input_ids)` is a one-step
prefill into a throwaway cache. Decode steps are free of host syncs so they can be graph-captured.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from beam_model.config import FULL, SLIDING, BeamConfig
from beam_model.functional import residual_coefficients, rms_norm
from beam_model.kv_cache import PagedKVCache, StepMetadata
from beam_model.quant.layout import quantize_layout, stored
from workbench.registry import POINTS, bind


def _param(*shape: int, dtype=None) -> nn.Parameter:
    # Built on the meta device: nothing is allocated until the weights are materialised.
    return nn.Parameter(torch.empty(*shape, device="meta", dtype=dtype), requires_grad=False)


class Norm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = _param(dim)


class Linear(nn.Module):
    """A bias-free projection's weight [out, in]; the math lives in the fusion points."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.weight = _param(out_features, in_features)


class Attention(nn.Module):
    def __init__(self, c: BeamConfig):
        super().__init__()
        h = c.hidden_size
        self.q_proj, self.k_proj, self.v_proj = Linear(c.q_width, h), Linear(c.kv_width, h), Linear(c.kv_width, h)
        self.gate_proj, self.o_proj = Linear(c.q_width, h), Linear(h, c.q_width)
        self.gate_bias = _param(c.num_attention_heads)
        self.q_norm, self.k_norm = Norm(c.head_dim), Norm(c.head_dim)


class DenseMLP(nn.Module):
    def __init__(self, c: BeamConfig):
        super().__init__()
        h, f = c.hidden_size, c.intermediate_size
        self.gate_proj, self.up_proj, self.down_proj = Linear(f, h), Linear(f, h), Linear(h, f)


class Router(nn.Module):
    def __init__(self, c: BeamConfig):
        super().__init__()
        self.weight = _param(c.n_routed_experts, c.hidden_size, dtype=torch.float32)
        self.e_score_correction_bias = _param(c.n_routed_experts, dtype=torch.float32)


class Experts(nn.Module):
    def __init__(self, c: BeamConfig):
        super().__init__()
        e, h, f = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
        self.gate_proj, self.up_proj, self.down_proj = _param(e, f, h), _param(e, f, h), _param(e, h, f)


class MoE(nn.Module):
    def __init__(self, c: BeamConfig):
        super().__init__()
        self.gate = Router(c)
        self.experts = Experts(c)


class DecoderLayer(nn.Module):
    def __init__(self, c: BeamConfig, index: int):
        super().__init__()
        self.index = index
        self.kind = c.layer_types[index]
        self.input_layernorm = Norm(c.hidden_size)
        self.post_attention_layernorm = Norm(c.hidden_size)
        self.pre_feedforward_layernorm = Norm(c.hidden_size)
        self.post_feedforward_layernorm = Norm(c.hidden_size)
        self.self_attn = Attention(c)
        self.mlp = MoE(c) if c.is_moe_layer(index) else DenseMLP(c)
        self.prepared: dict = {}


def prepared_layer(ops, layers: nn.ModuleList, i: int) -> dict:
    """Layer i's weights as the bound variants take them (each point's weight transform), by call site:
    its attention, its MLP (dense, or routing and experts) and its two boundaries, the second ending in
    the next layer's pre-norm (none after the last)."""
    layer = layers[i]
    a, mlp = layer.self_attn, layer.mlp
    next_norm = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else None
    device = layer.input_layernorm.weight.device

    def residual(k: int) -> torch.Tensor:
        return torch.tensor(residual_coefficients(k), dtype=torch.float32, device=device)

    p = {
        "qkvg_proj": ops.prepare("qkvg_proj", {k: stored(getattr(a, k), "weight")
                                               for k in ("q_proj", "k_proj", "v_proj", "gate_proj")}),
        "qk_prep": ops.prepare("qk_prep", dict(q_norm=a.q_norm.weight, k_norm=a.k_norm.weight)),
        "attn_out": ops.prepare("attn_out", dict(gate_bias=a.gate_bias, o_proj=stored(a.o_proj, "weight"))),
        "boundary_attn": ops.prepare("boundary", dict(post_norm=layer.post_attention_layernorm.weight,
                                                     next_norm=layer.pre_feedforward_layernorm.weight,
                                                     residual=residual(2 * i + 1))),
        "boundary_mlp": ops.prepare("boundary", dict(post_norm=layer.post_feedforward_layernorm.weight,
                                                    next_norm=next_norm, residual=residual(2 * i + 2))),
    }
    if isinstance(mlp, MoE):
        e = mlp.experts
        p["route"] = ops.prepare("route", dict(weight=mlp.gate.weight, bias=mlp.gate.e_score_correction_bias))
        p["experts"] = ops.prepare("experts", {k: stored(e, k) for k in ("gate_proj", "up_proj", "down_proj")})
    else:
        p["dense_mlp"] = ops.prepare("dense_mlp", {k: stored(getattr(mlp, k), "weight")
                                                   for k in ("gate_proj", "up_proj", "down_proj")})
    return p


class BeamModel(nn.Module):
    def __init__(self, c: BeamConfig):
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = _param(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = Norm(c.hidden_size)


class BeamForCausalLM(nn.Module):
    def __init__(self, config: BeamConfig, dtype=torch.bfloat16, quant=None):
        """`quant`: a `beam_model.quant.scheme.QuantScheme`, the projections it covers stored in its format
        (`beam_model.quant.layout`); None: every weight in `dtype`."""
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.quant = quant
        with torch.device("meta"):
            self.model = BeamModel(config)
            self.lm_head = nn.Module()
            self.lm_head.weight = _param(config.vocab_size, config.hidden_size)
        for name, p in self.named_parameters():
            if not _is_router(name):  # the router and its bias stay FP32 whatever the model dtype
                p.data = torch.empty(p.shape, device="meta", dtype=dtype)
        if quant is not None:
            for names, owner, attr in self.projections():
                covered = {quant.quantizes(n) for n in names}
                if len(covered) > 1:
                    raise ValueError(f"quantization_config.exclude_modules quantizes some of {names[0]} ... "
                                     f"{names[-1]} and not others; a layer's experts are stored as one stack")
                if covered.pop():
                    quantize_layout(owner, attr, quant.format)
        self.tp = None  # a beam_model.tp.TensorParallel when this model is one rank of several
        self.ops = None
        self.annotate = None  # optional (name, layer) -> context manager: profiler ranges per layer

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, *, seed: int = 0, dtype=torch.bfloat16, device=None, variants=None,
                    weights: str = "bf16"):
        return cls.random(BeamConfig.from_preset(name), seed=seed, dtype=dtype, device=device, variants=variants,
                          weights=weights)

    @classmethod
    def random(cls, config: BeamConfig, *, seed: int = 0, dtype=torch.bfloat16, device=None, variants=None,
               weights: str = "bf16"):
        """Seeded random weights; `weights` "fp8" or "nvfp4": the same random model's weights quantized as
        `workbench quantize` writes them, drawn one projection at a time (no full-precision copy)."""
        from beam_model.quant.scheme import QuantScheme
        from beam_model.weights import init_random

        model = cls(config, dtype, None if weights == "bf16" else QuantScheme.for_format(weights))
        init_random(model, seed=seed, device=device)
        model.set_variants(variants)
        return model

    @classmethod
    def from_pretrained(cls, path: str, *, dtype=torch.bfloat16, device=None, variants=None):
        """A checkpoint folder, BF16 or quantized (its config.json's `quantization_config`)."""
        from beam_model.quant.scheme import read_config
        from beam_model.weights import load_checkpoint

        config, quant = read_config(path)
        model = cls(config, dtype, quant)
        load_checkpoint(model, path, device=device)
        model.set_variants(variants)
        return model

    def save_pretrained(self, path: str) -> None:
        from beam_model.weights import save_checkpoint

        save_checkpoint(self, path)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def weights(self) -> str:
        """The projections' stored format: "bf16" (the model dtype), "fp8" or "nvfp4"."""
        return self.quant.format if self.quant is not None else "bf16"

    def projections(self):
        """(checkpoint module names, owner, attribute) of each projection a weight format may quantize;
        an experts stack lists each expert's module."""
        c = self.config
        for i, layer in enumerate(self.model.layers):
            prefix = f"model.layers.{i}"
            for proj in ("q_proj", "k_proj", "v_proj", "gate_proj", "o_proj"):
                yield [f"{prefix}.self_attn.{proj}"], getattr(layer.self_attn, proj), "weight"
            for proj in ("gate_proj", "up_proj", "down_proj"):
                if isinstance(layer.mlp, MoE):
                    yield ([f"{prefix}.mlp.experts.{e}.{proj}" for e in range(c.n_routed_experts)],
                           layer.mlp.experts, proj)
                else:
                    yield [f"{prefix}.mlp.{proj}"], getattr(layer.mlp, proj), "weight"

    # ---- variants -----------------------------------------------------------------------
    def set_variants(self, selection: dict[str, str] | None = None, configs: dict[str, dict] | None = None) -> None:
        """Bind the fusion-point variants (at their tuning configs) and apply their weight transforms."""
        ops = bind(selection, configs)
        wrong = [why for v in ops.variants.values() if (why := v.unsupported_weights(self.weights))]
        if wrong:
            raise ValueError(f"the model's weights are {self.weights}; " + "; ".join(wrong))
        self.ops = ops
        for i, layer in enumerate(self.model.layers):
            layer.prepared = prepared_layer(ops, self.model.layers, i)
        self.head_weights = ops.prepare("head", dict(norm=self.model.norm.weight, lm_head=self.lm_head.weight))

    # ---- compute ------------------------------------------------------------------------
    def _attention(self, layer: DecoderLayer, x, kv, meta):
        c, ops, p = self.config, self.ops, layer.prepared
        q, k, v, g = ops.qkvg_proj(x, p["qkvg_proj"])
        sliding = layer.kind == SLIDING
        q = ops.qk_prep(q, k, v, p["qk_prep"], cache=kv, slot_mapping=meta.slot_mapping, positions=meta.positions,
                        eps=c.rms_norm_eps, rope_theta=c.rope_theta if sliding else None,
                        ssmax=None if sliding else (c.ssmax_base, c.ssmax_exponent))
        return ops.attention_out(q, kv, meta, g, p["attn_out"], window=c.sliding_window if sliding else None,
                                 scale=c.head_dim ** -0.5)

    def _mlp(self, layer: DecoderLayer, x):
        c, ops, p = self.config, self.ops, layer.prepared
        if "dense_mlp" in p:
            return ops.dense_mlp(x, p["dense_mlp"])
        ids, weights = ops.route(x, p["route"], n_group=c.n_group, topk_group=c.topk_group,
                                 top_k=c.num_experts_per_tok, scale=c.routed_scaling_factor)
        if self.tp is not None:  # expert parallelism: the pairs of this rank's experts (tp.py)
            ids, weights = self.tp.local_experts(ids, weights)
        return ops.experts(x, ids, weights, p["experts"])

    def hidden_states(self, input_ids: torch.Tensor, cache: PagedKVCache, step: StepMetadata, *,
                      taps: tuple[int, ...] = ()):
        """Run every layer over the step's tokens [N]; returns the final residual stream [N, hidden], and
        with `taps` (layer indices) also those layers' output streams concatenated [N, len(taps) * hidden]
        (what a drafter reads): a pair."""
        c, ops = self.config, self.ops
        eps = c.rms_norm_eps
        group = self.tp.reduce_group if self.tp else None
        h = self.embed(input_ids)
        x = rms_norm(h, self.model.layers[0].input_layernorm.weight, eps).to(h.dtype)
        tapped = []
        for layer in self.model.layers:
            with self.annotate(f"layer.{layer.index}", layer) if self.annotate else nullcontext():
                meta = step.groups[FULL if layer.kind == FULL else SLIDING]
                y = self._attention(layer, x, cache.layer(layer.index), meta)
                h, x = ops.boundary(y, h, layer.prepared["boundary_attn"], eps=eps, group=group)
                y = self._mlp(layer, x)
                h, x = ops.boundary(y, h, layer.prepared["boundary_mlp"], eps=eps, group=group)
            if layer.index in taps:
                tapped.append(h)
        return (h, torch.cat(tapped, -1)) if taps else h

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp:  # vocab-parallel embedding
            return self.tp.embed(self.model.embed_tokens.weight, input_ids)
        return self.model.embed_tokens.weight[input_ids]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        c = self.config
        logits = self.ops.head(h, self.head_weights, eps=c.rms_norm_eps, softcap=c.final_logit_softcapping)
        return self.tp.gather_logits(logits) if self.tp else logits

    def replan(self, step: StepMetadata) -> None:
        """Redo the host-side plans of the bound variants that make them (FlashInfer attention) for a
        step whose metadata a graph runner refilled in place: call before replaying a captured step."""
        for point in POINTS:
            replan = getattr(getattr(self.ops, point), "replan", None)
            if replan is not None:
                for meta in step.groups.values():
                    replan(meta)

    def step(self, input_ids: torch.Tensor, cache: PagedKVCache, step: StepMetadata, *, all_logits: bool = False,
             taps: tuple[int, ...] = ()):
        """One engine step over a ragged batch of new tokens [N] (prefill chunks and/or decode tokens).

        Returns FP32 logits at each sequence's last new token [B, vocab], or at every token [N, vocab];
        with `taps`, a pair: those and the tapped layers' streams at every token (`hidden_states`)."""
        h = self.hidden_states(input_ids, cache, step, taps=taps)
        h, tapped = h if taps else (h, None)
        logits = self.logits(h if all_logits else h[step.last_token_index])
        return (logits, tapped) if taps else logits

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full-sequence prefill without a persistent cache: [T] or [B, T] -> FP32 logits [..., T, vocab]."""
        if input_ids.dim() not in (1, 2):
            raise ValueError(f"input_ids must be [T] or [B, T], got shape {tuple(input_ids.shape)}")
        ids = input_ids.to(self.device).reshape(-1, input_ids.shape[-1])
        b, t = ids.shape
        cache = PagedKVCache.for_sequences(self.config, [t] * b, dtype=self.dtype, device=self.device)
        for s in range(b):
            cache.add(s)
        step = cache.prepare_step(list(range(b)), [t] * b)
        logits = self.step(ids.flatten(), cache, step, all_logits=True)
        return logits.view(*input_ids.shape, -1)


def _is_router(name: str) -> bool:
    return ".mlp.gate." in name

