"""Planted faulty variants: each is wrong in one way a real kernel can be, and a gate must reject it.

Each entry of PLANTED builds a fresh `Variant` (fresh state: several plants remember earlier calls)
and names the gate check that must catch it. They are never registered in the product: tests build
them directly, or register one for the duration of a test and remove it after.
"""

from __future__ import annotations

import torch

from workbench.registry import Variant, reference
from workbench.variants.kernels.tensor_parallel import all_reduced


def _ref(point):
    return reference(point).fn


def window_off_by_one():
    def attention(q, cache, meta, *, window, scale):  # sees one key too many on sliding layers
        return _ref("attention")(q, cache, meta, window=None if window is None else window + 1, scale=scale)
    return attention


def bias_in_weights():
    def route(x, w, *, n_group, topk_group, top_k, scale):  # weights from the *biased* scores
        ids, _ = _ref("route")(x, w, n_group=n_group, topk_group=topk_group, top_k=top_k, scale=scale)
        biased = torch.sigmoid(x.float() @ w["weight"].float().t()) + w["bias"].float()
        weights = biased.gather(1, ids)
        return ids, weights / weights.sum(-1, keepdim=True) * scale
    return route


def ssmax_on_sliding():
    def qk_prep(q, k, v, w, *, cache, slot_mapping, positions, eps, rope_theta=None, ssmax=None):
        return _ref("qk_prep")(q, k, v, w, cache=cache, slot_mapping=slot_mapping, positions=positions, eps=eps,
                               rope_theta=rope_theta, ssmax=ssmax or (2048.0, 0.1))  # SSMax on SWA layers too
    return qk_prep


def partial_write():
    def dense_mlp(x, w):  # the last row is never written
        y = _ref("dense_mlp")(x, w)
        out = torch.empty_like(y)
        out[:-1] = y[:-1]
        return out
    return dense_mlp


def stale_by_pointer():
    memo = {}

    def attn_out(o, g, w):  # "same input buffer, same result": wrong once the buffer is refilled
        key = (o.data_ptr(), g.data_ptr())
        if key not in memo:
            memo[key] = _ref("attn_out")(o, g, w)
        return memo[key].clone()
    return attn_out


def first_call_only():
    memo = []

    def head(h, w, *, eps, softcap):  # right for the first inputs it sees, then replays them
        if not memo:
            memo.append(_ref("head")(h, w, eps=eps, softcap=softcap))
        return memo[0].clone()
    return head


def wrong_dtype():
    def attn_out(o, g, w):  # forgot to round the output: FP32 instead of the model dtype
        n, heads, hd = o.shape
        gate = torch.sigmoid(g.float().view(n, heads, hd) + w["gate_bias"].float()[None, :, None])
        return (o.float() * gate).reshape(n, heads * hd) @ w["o_proj"].float().t()
    return attn_out


def nondeterministic():
    def experts(x, ids, weights, w):  # atomics-style: the last bit of each element depends on the run
        y = _ref("experts")(x, ids, weights, w)
        bits = y.view({2: torch.int16, 4: torch.int32}[y.element_size()])
        # each element's lowest bit flipped or not at random: always within tolerance, never twice alike
        # (a relative jitter below the BF16 ulp rounded to the same bits in ~5% of gate runs)
        return (bits ^ (torch.rand(y.shape, device=y.device) < 0.5).to(bits.dtype)).view(y.dtype)
    return experts


def residual_in_place():
    def boundary(y, h, w, *, eps, group=None):  # vLLM-style fused add: the residual updated in place
        h_new, x_next = _ref("boundary")(y, h, w, eps=eps, group=group)
        h.copy_(h_new)
        return h, x_next
    return boundary


def writes_next_slot():
    def qk_prep(q, k, v, w, *, cache, slot_mapping, positions, eps, rope_theta=None, ssmax=None):
        out = _ref("qk_prep")(q, k, v, w, cache=cache, slot_mapping=slot_mapping, positions=positions, eps=eps,
                              rope_theta=rope_theta, ssmax=ssmax)
        ps = cache.shape[2]
        spill = (slot_mapping + 1) % (cache.shape[0] * ps)  # K also stomps on the neighbouring slot
        cache[spill // ps, 0, spill % ps] = 0
        return out
    return qk_prep


def decode_only():
    def attention(q, cache, meta, *, window, scale):  # no `supports`, yet no prefill path either
        if not meta.decode:
            raise NotImplementedError("prefill is not implemented in this kernel")
        return _ref("attention")(q, cache, meta, window=window, scale=scale)
    return attention


def ignores_top_p():
    def sample(logits, temperature, top_k, top_p, *, generator=None, allowed=None):
        return _ref("sample")(logits, temperature, top_k, torch.ones_like(top_p), generator=generator,
                              allowed=allowed)
    return sample


def ignores_mask():
    def sample(logits, temperature, top_k, top_p, *, generator=None, allowed=None):  # a grammar's mask dropped
        return _ref("sample")(logits, temperature, top_k, top_p, generator=generator)
    return sample


def one_group_score():
    def route(x, w, *, n_group, topk_group, top_k, scale):  # groups scored by their best expert only
        scores = torch.sigmoid(x.float() @ w["weight"].float().t())
        biased = scores + w["bias"].float()
        n, e = biased.shape
        kept = biased.view(n, n_group, -1).max(-1).values.topk(topk_group, dim=-1).indices
        mask = torch.zeros(n, n_group, dtype=torch.bool, device=x.device).scatter_(1, kept, True)
        ids = biased.masked_fill(~mask.repeat_interleave(e // n_group, 1), float("-inf")).topk(top_k, -1).indices
        weights = scores.gather(1, ids)
        return ids, weights / weights.sum(-1, keepdim=True) * scale
    return route


def one_vector_wrong():
    def boundary(y, h, w, *, eps, group=None):  # the last row's first 16 bytes stored from its next 16
        h_new, x_next = _ref("boundary")(y, h, w, eps=eps, group=group)
        h_new[-1, :8] = h_new[-1, 8:16].clone()
        return h_new, x_next
    return boundary


def prepare_scales_in_place():
    """The reference, behind a weight-layout transform that folds a factor into the model's own down
    weight (in place) instead of a copy: every output still matches the reference, which reads the
    same weights, but the model's other readers now see a doubled weight."""
    def prepare(w):
        w["down_proj"].mul_(2)
        return w
    return _ref("dense_mlp"), prepare


def gate_without_bias():
    def attention_out(q, cache, meta, g, w, *, window, scale):  # a fused tail that drops the gate's bias
        return _ref("attention_out")(q, cache, meta, g, {**w, "gate_bias": torch.zeros_like(w["gate_bias"])},
                                     window=window, scale=scale)
    return attention_out


# name -> (point, factory, the check that must fail); a factory returns the variant's function, or
# (function, weight-layout transform)
def draft_block_causal():
    def draft_attention(q, store, pages, offsets, mask):  # a block's row sees only the block's rows before it
        s = pages.shape[0]
        b = q.shape[0] // s
        out = torch.empty_like(q)
        for i in range(b):
            causal = mask.clone()
            causal[:, pages.shape[1] - b + i + 1:] = float("-inf")
            rows = torch.arange(s, device=q.device) * b + i
            out[rows] = _ref("draft_attention")(q[rows], store, pages, offsets, causal)
        return out
    return draft_attention


def draft_mask_ignored():
    def draft_attention(q, store, pages, offsets, mask):  # attends to context keys that do not exist
        return _ref("draft_attention")(q, store, pages, offsets, torch.zeros_like(mask))
    return draft_attention


PLANTED = {
    "window_off_by_one": ("attention", window_off_by_one, "accuracy"),
    "bias_in_weights": ("route", bias_in_weights, "route_weights"),
    "ssmax_on_sliding": ("qk_prep", ssmax_on_sliding, "accuracy"),
    "partial_write": ("dense_mlp", partial_write, "finite"),
    "stale_by_pointer": ("attn_out", stale_by_pointer, "fresh_inputs"),
    "first_call_only": ("head", first_call_only, "fresh_inputs"),
    "wrong_dtype": ("attn_out", wrong_dtype, "signature"),
    "nondeterministic": ("experts", nondeterministic, "deterministic"),
    "residual_in_place": ("boundary", residual_in_place, "inputs_unchanged"),
    "writes_next_slot": ("qk_prep", writes_next_slot, "inplace_bounds"),
    "decode_only": ("attention", decode_only, "runs"),
    "ignores_top_p": ("sample", ignores_top_p, "support"),
    "ignores_mask": ("sample", ignores_mask, "masked greedy"),
    "one_group_score": ("route", one_group_score, "route_ids"),
    "one_vector_wrong": ("boundary", one_vector_wrong, "accuracy"),
    "prepare_scales_in_place": ("dense_mlp", prepare_scales_in_place, "inputs_unchanged"),
    "gate_without_bias": ("attention_out", gate_without_bias, "accuracy"),
    "draft_block_causal": ("draft_attention", draft_block_causal, "accuracy"),
    "draft_mask_ignored": ("draft_attention", draft_mask_ignored, "accuracy"),
}


def planted(name: str) -> Variant:
    point, factory, _ = PLANTED[name]
    made = factory()
    fn, prepare = made if isinstance(made, tuple) else (made, None)
    return Variant(point, f"planted_{name}", "torch", fn, prepare=prepare)


# ---- faults of quantized weights: each gated at workloads whose weights are stored in its format -----

def _e2m1(codes):
    from beam_model.quant.formats import E2M1_VALUES

    grid = torch.tensor(E2M1_VALUES, device=codes.device)
    c = codes.long()
    return torch.where(c & 8 > 0, -1.0, 1.0) * grid[c & 7]


def _nvfp4_dense(w, *, swap=False, global_scale=True):
    lo, hi = w.weight & 0x0F, w.weight >> 4
    codes = torch.stack((hi, lo) if swap else (lo, hi), -1).flatten(-2)
    values = _e2m1(codes) * w.scale.float().repeat_interleave(16, -1)
    return values * w.scale_2.float()[..., None, None] if global_scale else values


def _experts_with(dequantize):
    def experts(x, ids, weights, w):
        return _ref("experts")(x, ids, weights, {k: dequantize(v).to(x.dtype) for k, v in w.items()})
    return experts


def nvfp4_nibbles_swapped():
    return _experts_with(lambda w: _nvfp4_dense(w, swap=True))  # the odd input read from the low nibble


def nvfp4_global_scale_forgotten():
    return _experts_with(lambda w: _nvfp4_dense(w, global_scale=False))


def fp8_scale_on_input_axis():
    def qkvg_proj(x, w):  # each weight scaled by its column's scale (square q/gate: it broadcasts)
        dense = {k: (v.weight.float() * v.scale.float().view(1, -1)).to(x.dtype)
                 if v.shape[0] == v.shape[1] else v.dequantize(x.dtype) for k, v in w.items()}
        return _ref("qkvg_proj")(x, dense)
    return qkvg_proj


def fp8_activations_unclamped():
    # activations to E4M3 at the first token's scale, larger tokens past 448: saturated, or NaN where the cast
    # does not saturate (it does on some torch builds and not others): wrong either way
    def dense_mlp(x, w):
        scale = x[:1].float().abs().amax() / 448.0
        xq = (x.float() / scale).to(torch.float8_e4m3fn).float() * scale
        return _ref("dense_mlp")(xq.to(x.dtype), w)
    return dense_mlp


# name -> (point, factory, the check that must catch it, the weight format it reads)
QUANT_PLANTED = {
    "nvfp4_nibbles_swapped": ("experts", nvfp4_nibbles_swapped, "accuracy", "nvfp4"),
    "nvfp4_global_scale_forgotten": ("experts", nvfp4_global_scale_forgotten, "accuracy", "nvfp4"),
    "fp8_scale_on_input_axis": ("qkvg_proj", fp8_scale_on_input_axis, "accuracy", "fp8"),
    "fp8_activations_unclamped": ("dense_mlp", fp8_activations_unclamped, "accuracy", "fp8"),
}


def quant_planted(name: str) -> Variant:
    point, factory, _, fmt = QUANT_PLANTED[name]
    return Variant(point, f"planted_{name}", "torch", factory(), formats=(fmt,))


# ---- faults of variants that quantize their activations to E4M3 (held to the looser FP8-activation
# tolerance, PointSpec.activation_tolerance) ------------------------------------------------------------

def _dense_mlp_fp8_rows(quantize_rows):
    from workbench.variants.kernels.fp8_scaled_mm import fp8_gemm

    def dense_mlp(x, w):  # dense_mlp:fp8_scaled_mm with `quantize_rows` in place of the per-token rule
        g = fp8_gemm(*quantize_rows(x), w["gate_proj"], x.dtype).float()
        u = fp8_gemm(*quantize_rows(x), w["up_proj"], x.dtype).float()
        return fp8_gemm(*quantize_rows((torch.nn.functional.silu(g) * u).to(x.dtype)), w["down_proj"], x.dtype)
    return dense_mlp


def fp8_activation_scale_dropped():
    from beam_model.quant.formats import quantize_fp8

    def rows(x):  # E4M3 codes of x / its scale, the scale never applied to the GEMM
        codes, scale = quantize_fp8(x)
        return codes, torch.ones_like(scale)
    return _dense_mlp_fp8_rows(rows)


def fp8_activation_scale_of_the_first_token():
    from beam_model.quant.formats import to_e4m3

    def rows(x):  # one scale for every row, from the first row's amax: larger rows saturate at 448
        scale = x[:1].float().abs().amax().clamp(min=1e-12) / 448.0
        return to_e4m3(x.float() / scale), scale.expand(x.shape[0], 1).contiguous()
    return _dense_mlp_fp8_rows(rows)


def fp8_activation_rounding_undeclared():
    # the right per-token rule, but the variant does not say it quantizes activations: held to the
    # reference's BF16 tolerance, which the rounding of 3 mantissa bits is far outside
    from beam_model.quant.formats import quantize_fp8

    return _dense_mlp_fp8_rows(quantize_fp8)


def fp8_gate_bias_by_channel():
    from beam_model.quant.formats import quantize_fp8
    from workbench.variants.kernels.fp8_scaled_mm import fp8_gemm

    def attn_out(o, g, w):  # attn_out:fp8_scaled_mm's gate with the bias indexed by channel, not by head
        n, heads, hd = o.shape
        bias = w["gate_bias"].float()[torch.arange(heads * hd, device=o.device) % heads]
        gated = (o.float().reshape(n, heads * hd) * torch.sigmoid(g.float() + bias)).to(o.dtype)
        return fp8_gemm(*quantize_fp8(gated), w["o_proj"], o.dtype)
    return attn_out


# name -> (point, factory, the check that must catch it, the activation format it declares)
ACTIVATION_PLANTED = {
    "fp8_gate_bias_by_channel": ("attn_out", fp8_gate_bias_by_channel, "accuracy", "fp8"),
    "fp8_activation_scale_dropped": ("dense_mlp", fp8_activation_scale_dropped, "accuracy", "fp8"),
    "fp8_activation_scale_of_the_first_token": ("dense_mlp", fp8_activation_scale_of_the_first_token, "accuracy",
                                                "fp8"),
    "fp8_activation_rounding_undeclared": ("dense_mlp", fp8_activation_rounding_undeclared, "accuracy", None),
}


def activation_planted(name: str) -> Variant:
    point, factory, _, activations = ACTIVATION_PLANTED[name]
    return Variant(point, f"planted_{name}", "torch", factory(), formats=("fp8",), activations=activations)


# ---- faults across tensor-parallel ranks: each gated by the rank gate (workbench/rank_gate.py) ----------

def skips_the_all_reduce():
    def boundary(y, h, w, *, eps, group=None):  # right on one GPU, where group is None
        return _ref("boundary")(y, h, w, eps=eps, group=None)
    return boundary


def reduces_in_place():
    def boundary(y, h, w, *, eps, group=None):  # sums into the sub-layer's output, which the contract keeps
        if group is not None:
            torch.distributed.all_reduce(y, group=group)
        return _ref("boundary")(y, h, w, eps=eps, group=None)
    return boundary


def own_partial_first():
    def boundary(y, h, w, *, eps, group=None):  # a one-shot all-reduce adding the peers' partials from its own
        if group is not None:
            parts = [torch.empty_like(y) for _ in range(torch.distributed.get_world_size(group))]
            torch.distributed.all_gather(parts, y.contiguous(), group=group)
            me = torch.distributed.get_rank(group)
            y = parts[me].clone()
            for i in range(1, len(parts)):
                y += parts[(me + i) % len(parts)]  # three or more bf16 addends: the order changes the rounding
        return _ref("boundary")(y, h, w, eps=eps, group=None)
    return boundary


def rank0_reduces_alone():
    def boundary(y, h, w, *, eps, group=None):  # the other ranks never join rank 0's all-reduce
        if group is not None and torch.distributed.get_rank(group) != 0:
            group = None
        return _ref("boundary")(y, h, w, eps=eps, group=group)
    return boundary


# name -> (factory, the rank gate's check that must fail, ranks it takes to show)
RANK_PLANTED = {
    "skips_the_all_reduce": (skips_the_all_reduce, "accuracy", 2),
    "reduces_in_place": (reduces_in_place, "inputs unchanged", 2),
    "own_partial_first": (own_partial_first, "ranks agree", 3),
    "rank0_reduces_alone": (rank0_reduces_alone, "runs", 2),
}


def rank_planted(name: str) -> Variant:
    """A picklable loader for the rank gate's spawned ranks: functools.partial(rank_planted, name)."""
    return Variant("boundary", f"planted_{name}", "torch", RANK_PLANTED[name][0]())


# ---- faults only real activations show: gated on calls captured from the trained model on held-out text --

def squares_summed_in_model_dtype():
    def boundary(y, h, w, *, eps, group=None):  # the post-norm's sum of squares held in y's dtype
        from beam_model.functional import rms_norm

        y = all_reduced(y, group)
        squares = (y * y).sum(-1, keepdim=True)  # FP16 saturates to inf past 65504: the row's norm becomes 0
        post = y.float() * torch.rsqrt(squares.float() / y.shape[-1] + eps) * w["post_norm"].float()
        a, b = w["residual"][0], w["residual"][1]
        h_new = (a * h.float() + b * post).to(h.dtype)
        return h_new, None if w["next_norm"] is None else rms_norm(h_new, w["next_norm"], eps).to(h.dtype)
    return boundary


# name -> (point, factory, the check that must catch it, the dtype it shows at). Random inputs (rows of RMS
# ~1) pass; the trained beam-mini's sub-layer outputs reach rows whose squares sum past FP16's range.
TEXT_PLANTED = {
    "squares_summed_in_model_dtype": ("boundary", squares_summed_in_model_dtype, "accuracy", "fp16"),
}


def text_planted(name: str) -> Variant:
    point, factory, _, _ = TEXT_PLANTED[name]
    return Variant(point, f"planted_{name}", "torch", factory())
