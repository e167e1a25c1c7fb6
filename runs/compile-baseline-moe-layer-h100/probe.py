"""A sliding-window MoE decode layer written as a careful user writes one for torch.compile, against the
model's own step (compiled whole, reference and plain variants), per layer, at beam-501b-tp8's shapes.

Both sides run N sliding MoE layers (first_k_dense_replace 0, no full layer) on the same weights; a
layer's time is (T(N2) - T(N1)) / (N2 - N1), so the embedding, head and sampling of the model's step
cancel. The independent layer keeps its sliding-window K/V in a ring buffer of `window` slots, packs
q/k/v/gate and each expert's gate/up into one weight, and gathers the routed experts for two batched
GEMVs; routing is the reference's FP32 grouped top-k. `check` first runs both, in FP32 on the CPU at a
small width, and asserts they compute the same logits. Every step is timed in a CUDA graph by
`workbench.timing.time_fn`, as the end-to-end stage times a build.

    PYTHONPATH=. python3 runs/compile-baseline-moe-layer-h100/probe.py check
    PYTHONPATH=. python3 runs/compile-baseline-moe-layer-h100/probe.py OUT N [MODE] [BUILDS]   # once per N
    PYTHONPATH=. python3 runs/compile-baseline-moe-layer-h100/probe.py summarize OUT
"""
import dataclasses
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from beam_model.config import SLIDING, BeamConfig
from beam_model.functional import residual_coefficients, rms_norm, rope_cos_sin, soft_cap
from beam_model.model import BeamForCausalLM
from workbench import timing
from workbench.targets import StepRunner, get_target

def sliding_moe_config(preset: str, layers: int) -> BeamConfig:
    c = BeamConfig.from_preset(preset)
    return dataclasses.replace(c, num_hidden_layers=layers, layer_types=[SLIDING] * layers, first_k_dense_replace=0)


class IndependentLayer:
    """One sliding MoE decoder layer at batch 1, from a model layer's weights (the stream h and the
    pre-normed x in, the same pair out, as the model's boundaries hand them on)."""

    def __init__(self, model, i: int, *, context: int, generator: torch.Generator):
        c, layers = model.config, model.model.layers
        layer = layers[i]
        a, mlp = layer.self_attn, layer.mlp
        self.c = c
        self.wqkvg = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.gate_proj.weight])
        self.wo, self.gate_bias = a.o_proj.weight, a.gate_bias
        self.q_norm, self.k_norm = a.q_norm.weight, a.k_norm.weight
        self.post_attn, self.pre_ffn = layer.post_attention_layernorm.weight, layer.pre_feedforward_layernorm.weight
        self.post_ffn = layer.post_feedforward_layernorm.weight
        self.next_norm = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else None
        self.router, self.router_bias = mlp.gate.weight, mlp.gate.e_score_correction_bias
        e = mlp.experts
        self.w13 = torch.cat([e.gate_proj, e.up_proj], 1)  # [E, 2 ff, hidden]
        self.w2 = e.down_proj  # [E, hidden, ff]
        self.res_attn = residual_coefficients(2 * i + 1)
        self.res_mlp = residual_coefficients(2 * i + 2)
        shape = (c.sliding_window, c.num_key_value_heads, c.head_dim)
        self.k_cache = torch.randn(shape, generator=generator, device=model.device).to(model.dtype)
        self.v_cache = torch.randn(shape, generator=generator, device=model.device).to(model.dtype)
        if context == 0:  # nothing before the step: the ring starts empty
            self.k_cache.zero_(), self.v_cache.zero_()

    def __call__(self, h, x, pos, cos, sin):
        c = self.c
        hq, hkv, d, w = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.sliding_window
        q, k, v, g = F.linear(x, self.wqkvg).split([hq * d, hkv * d, hkv * d, hq * d], -1)
        q = rope(rms_norm(q.view(hq, d), self.q_norm, c.rms_norm_eps), cos, sin)
        k = rope(rms_norm(k.view(hkv, d), self.k_norm, c.rms_norm_eps), cos, sin)
        slot = pos % w
        self.k_cache.index_copy_(0, slot, k.to(x.dtype)[None])
        self.v_cache.index_copy_(0, slot, v.view(1, hkv, d))
        qg = q.view(hkv, hq // hkv, d)
        scores = torch.einsum("hgd,jhd->hgj", qg, self.k_cache.float()) * d ** -0.5
        scores = scores.masked_fill(torch.arange(w, device=x.device) > pos, float("-inf"))  # slots not yet written
        o = torch.einsum("hgj,jhd->hgd", scores.softmax(-1), self.v_cache.float()).reshape(hq, d)
        o = o.to(x.dtype).float() * torch.sigmoid(g.view(hq, d).float() + self.gate_bias.float()[:, None])
        y = F.linear(o.to(x.dtype).view(1, hq * d), self.wo)
        h, x = boundary(y, h, self.post_attn, self.pre_ffn, self.res_attn, c.rms_norm_eps)
        ids, weights = route(x, self.router, self.router_bias, c)
        ff = c.moe_intermediate_size
        gu = torch.bmm(self.w13[ids], x.view(1, -1, 1).expand(len(ids), -1, -1)).float()  # [k, 2 ff, 1]
        act = (F.silu(gu[:, :ff]) * gu[:, ff:]).to(x.dtype)
        out = torch.bmm(self.w2[ids], act).squeeze(-1)  # [k, hidden]
        y = (out.float() * weights[:, None]).sum(0, keepdim=True).to(x.dtype)
        return boundary(y, h, self.post_ffn, self.next_norm, self.res_mlp, c.rms_norm_eps)


def rope(x, cos, sin):
    x1, x2 = x.chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def boundary(y, h, post_norm, next_norm, coefficients, eps):
    a, b = coefficients
    h = (a * h.float() + b * rms_norm(y, post_norm, eps).to(y.dtype).float()).to(y.dtype)
    return h, (rms_norm(h, next_norm, eps).to(h.dtype) if next_norm is not None else h)


def route(x, weight, bias, c):
    s = (x.float() @ weight.T).sigmoid()[0]
    biased = s + bias
    groups = biased.view(c.n_group, -1)
    keep = groups.topk(2, -1).values.sum(-1).topk(c.topk_group).indices
    masked = torch.full_like(groups, float("-inf")).index_copy(0, keep, groups[keep]).view(-1)
    ids = masked.topk(c.num_experts_per_tok).indices
    w = s[ids]
    return ids, w / w.sum() * c.routed_scaling_factor


class IndependentStack:
    """N independent layers after the model's embedding and first pre-norm, with its final norm and head:
    the logits at one token."""

    def __init__(self, model, *, context: int, seed: int = 0):
        gen = torch.Generator(device=model.device).manual_seed(seed)
        self.model = model
        self.layers = [IndependentLayer(model, i, context=context, generator=gen)
                       for i in range(model.config.num_hidden_layers)]

    def __call__(self, input_ids, pos):
        m, c = self.model, self.model.config
        h = m.model.embed_tokens.weight[input_ids]
        x = rms_norm(h, m.model.layers[0].input_layernorm.weight, c.rms_norm_eps).to(h.dtype)
        cos, sin = rope_cos_sin(pos.view(1), c.head_dim, c.rope_theta)
        for layer in self.layers:
            h, x = layer(h, x, pos, cos, sin)
        final = rms_norm(h, m.model.norm.weight, c.rms_norm_eps).to(h.dtype)
        return soft_cap(F.linear(final, m.lm_head.weight), c.final_logit_softcapping)


def check() -> None:
    """The independent stack, fed a prompt one token at a time past its window, gives the model's logits at
    every position (FP32, CPU)."""
    cfg = dataclasses.replace(sliding_moe_config("beam-tiny", 3), num_key_value_heads=1)
    model = BeamForCausalLM.random(cfg, dtype=torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (cfg.sliding_window + 8,), generator=torch.Generator().manual_seed(1))
    want = model.forward(ids[None])[0]
    stack = IndependentStack(model, context=0)
    got = torch.stack([stack(ids[p:p + 1], torch.tensor(p))[0] for p in range(len(ids))])
    err = (got - want).abs().max().item()
    assert err < 1e-4, f"the independent layers compute other logits than the model's (max error {err})"
    print(f"check passed: max logit error {err:.2e} at {len(ids)} positions over {cfg.num_hidden_layers} "
          f"sliding MoE layers (window {cfg.sliding_window})")


class GraphedStack:
    """The independent stack's decode step (context `target.context`), compiled in `mode` and captured."""

    def __init__(self, model, target, mode: str | None):
        self.stack = IndependentStack(model, context=target.context)
        self.ids = torch.randint(0, model.config.vocab_size, (1,), device=model.device)
        self.pos = torch.tensor(target.context, device=model.device)
        def step():
            return self.stack(self.ids, self.pos)

        fn = torch.compile(step, mode=mode, dynamic=False) if mode else step
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.inference_mode():
            self.out = fn()

    def __call__(self):
        self.graph.replay()
        return self.out


# The model's builds: the reference step, then plain-PyTorch variants a careful user would write, added one by one.
BUILDS = {
    "model": {},
    "model-window": {"attention": "window"},
    "model-window-packed": {"attention": "window", "qkvg_proj": "packed"},
    "model-window-packed-unsorted": {"attention": "window", "qkvg_proj": "packed", "route": "unsorted"},
}


def main(out: str, n: int, mode: str, builds: list[str]) -> None:
    """Each build of `builds` (and "independent") at n layers, compiled in `mode`: step times in
    probe-{n}.json, torch.profiler's kernel table of five steps in kernels-{build}-{n}.txt."""
    os.makedirs(out, exist_ok=True)
    res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "layers": n, "mode": mode,
           "builds": {b: BUILDS.get(b) for b in builds}, "steps": {}}
    target = get_target("decode-b1")

    def save(name, fn, build_s):
        r = timing.time_fn(fn, device="cuda", budget_s=2.0)
        res["steps"][name] = {"median_us": r["median_us"], "build_s": build_s}
        print(name, n, res["steps"][name], flush=True)
        json.dump(res, open(f"{out}/probe-{n}.json", "w"), indent=1)
        from torch.profiler import ProfilerActivity
        with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        table = p.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=100)
        open(f"{out}/kernels-{name}-{n}.txt", "w").write(table)

    model = BeamForCausalLM.random(sliding_moe_config("beam-501b-tp8", n), dtype=torch.bfloat16, device="cuda")
    runner = StepRunner(model, target)
    for name in builds:
        s = time.time()
        if name == "independent":
            fn = GraphedStack(model, target, mode)
        else:
            runner.rebind(BUILDS[name], compile_mode=mode)
            fn = runner
        save(name, fn, time.time() - s)
        del fn
        torch._dynamo.reset()


def summarize(folder: str) -> None:
    """probe.json: each build's step at every size run, and its time per layer from the smallest and
    largest sizes (the embedding, head and sampling cancel)."""
    runs = sorted((json.load(open(os.path.join(folder, f))) for f in os.listdir(folder)
                   if f.startswith("probe-") and f.endswith(".json")), key=lambda r: r["layers"])
    small, large = runs[0], runs[-1]
    steps = {b: {str(r["layers"]): r["steps"][b]["median_us"] for r in runs if b in r["steps"]}
             for b in large["steps"]}
    per_layer = {b: (large["steps"][b]["median_us"] - small["steps"][b]["median_us"])
                 / (large["layers"] - small["layers"]) for b in large["steps"] if b in small["steps"]}
    out = {k: large[k] for k in ("torch", "gpu", "mode", "builds")}
    out.update(step_us=steps, per_layer_us=per_layer)
    json.dump(out, open(os.path.join(folder, "probe.json"), "w"), indent=1)
    print(json.dumps(per_layer, indent=1))


if __name__ == "__main__":
    if sys.argv[1] == "check":
        check()
    elif sys.argv[1] == "summarize":
        summarize(sys.argv[2])
    else:
        main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "max-autotune-no-cudagraphs",
             (sys.argv[4] if len(sys.argv) > 4 else ",".join([*BUILDS, "independent"])).split(","))
