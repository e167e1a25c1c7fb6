"""The compound point `attention_out` (attention, then attn_out): binding, the lock, the profiler, the
search's incumbent, and `attention_out:triton` and its prefetching form (Triton interpreter, beam-tiny
shapes; TP8 shapes under the `gpu` marker)."""

import types

import pytest
import torch
import yaml

from workbench import registry
from workbench.lock import Lock, verify
from workbench.points import Workload, spec
from workbench.registry import Variant, bind

DECODE = Workload(batch=2, context=1000)
PREFILL = Workload(batch=2, tokens_per_seq=20, context=100)


def _call(wl, seed=0):
    return spec("attention_out").make_inputs(wl, "cpu", seed)


def _apart(call, attention, attn_out):
    q, cache, meta, g, w = call.args
    return attn_out(attention(q, cache, meta, **call.kwargs), g, w)


def test_reference_is_the_members_references_in_sequence():
    for wl in (DECODE, PREFILL.with_(layer="full")):
        call = _call(wl)
        ref = registry.reference("attention_out").fn(*call.args, **call.kwargs)
        apart = _apart(call, registry.reference("attention").fn, registry.reference("attn_out").fn)
        assert torch.equal(ref, apart)


def test_binding_without_a_fusion_runs_the_members_selected_variants(monkeypatch):
    mine = Variant("attn_out", "mine", "torch", registry.reference("attn_out").fn)
    monkeypatch.setitem(registry.variants("attn_out"), "mine", mine)
    ops = bind({"attn_out": "mine"})
    seen = []
    for member in ("attention", "attn_out"):
        fn = getattr(ops, member)
        setattr(ops, member, lambda *a, _fn=fn, _m=member, **k: seen.append(_m) or _fn(*a, **k))
    call = _call(DECODE)
    ops.attention_out(*call.args, **call.kwargs)
    assert seen == ["attention", "attn_out"] and ops.variants["attn_out"] is mine


def test_a_fusion_replaces_the_members_and_refuses_a_member_that_relays_weights(monkeypatch):
    table = registry.variants("attention_out")
    monkeypatch.setitem(table, "fused", Variant("attention_out", "fused", "torch", table["torch"].fn))
    ops = bind({"attention_out": "fused"})
    assert ops.attention_out is table["fused"].fn
    relaid = Variant("attn_out", "relaid", "torch", registry.reference("attn_out").fn, prepare=lambda w: dict(w))
    monkeypatch.setitem(registry.variants("attn_out"), "relaid", relaid)
    with pytest.raises(ValueError, match="attn_out:relaid re-lays them at load time"):
        bind({"attention_out": "fused", "attn_out": "relaid"})
    bind({"attn_out": "relaid"})  # apart, the member's own layout is what the model prepares


def test_a_lock_from_before_the_compound_still_verifies(tmp_path):
    """Locks written before `attention_out` existed have no entry for it: those builds ran attention and
    attn_out apart, which is what its absence means. Any other missing point is a problem."""
    lock = Lock(model={"preset": "beam-tiny"}, target="decode-b1", environment={},
                points={p: Lock.entry(p, "torch") for p in registry.POINTS if p != "attention_out"})
    path = tmp_path / "lock.yaml"
    lock.save(str(path))
    assert Lock.load(str(path))[1] == []
    assert "attention_out" not in Lock.load(str(path))[0].selection
    doc = yaml.safe_load(path.read_text())
    del doc["points"]["attn_out"]
    doc["digest"] = Lock._digest({k: v for k, v in doc.items() if k != "digest"})
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert any("points missing from the lock: ['attn_out']" in p for p in verify(str(path), run_gates=False).problems)


def test_the_search_times_a_compound_against_its_members_choices(monkeypatch):
    from workbench.search import Search

    search = Search.__new__(Search)
    search.model = types.SimpleNamespace(ops=bind())
    search.choices = {"attention": ("torch_compile", None)}
    apart = search._members_apart("attention_out")
    assert apart.fn.args[0].attention is registry.get("attention", "torch_compile").fn
    assert apart.fn.args[0].attn_out is registry.reference("attn_out").fn  # not searched: the bound one
    call = _call(DECODE)
    want = registry.reference("attention_out").fn(*call.args, **call.kwargs)
    assert torch.equal(apart.fn(*call.args, **call.kwargs), want)
    assert search._relaid_members("attention_out") is None
    relaid = Variant("attn_out", "relaid", "torch", registry.reference("attn_out").fn, prepare=lambda w: dict(w))
    monkeypatch.setitem(registry.variants("attn_out"), "relaid", relaid)
    search.choices["attn_out"] = ("relaid", None)
    assert "attn_out:relaid re-lays its weights" in search._relaid_members("attention_out")
    assert search._members_apart("attention_out").prepare is relaid.prepare


def test_profile_counts_a_compound_apart_and_a_fused_one_in_its_own_range(monkeypatch):
    from harness_helpers import tiny_runner

    from workbench.profiler.attribution import profile_step

    runner = tiny_runner()
    floors = dict(workload_for=lambda kind: runner.target.workload("beam-tiny", "fp32", kind),
                  ceilings={"bandwidth_Bps": 1e11, "matmul_flops": 1e12})
    points = {p.point: p for p in profile_step(runner, **floors).points}
    assert points["attention_out"].calls == points["attention"].calls > 0
    assert points["attention_out"].time_us == 0 and points["attention"].time_us > 0
    assert points["attention_out"].floor_us is None and points["attention"].floor_us > 0  # counted once
    table = registry.variants("attention_out")
    monkeypatch.setitem(table, "fused", Variant("attention_out", "fused", "torch", table["torch"].fn))
    runner.rebind({"attention_out": "fused"})
    points = {p.point: p for p in profile_step(runner, **floors).points}
    assert points["attention_out"].time_us > 0 and points["attention_out"].floor_us > 0
    assert "attention" not in points and "attn_out" not in points


# ---- attention_out:triton (interpreter) ------------------------------------------------------------

triton_only = pytest.mark.skipif(registry.backend_available("triton")[0] is False, reason="needs triton")


@triton_only
@pytest.mark.parametrize("layer", ["sliding", "full"])
def test_triton_decode_is_bitwise_the_members_triton_variants_apart(layer):
    """Merge and gate in one kernel give the bits of attention:triton's merge kernel, then
    attn_out:triton_gemv's gate kernel and GEMV, at the same configs."""
    from workbench.variants.attention_out.triton import CONFIGS

    wl = DECODE.with_(layer=layer)
    for config in CONFIGS:
        call = _call(wl, seed=3)
        fused = registry.get("attention_out", "triton").at(config)(*call.args, **call.kwargs)
        apart = _apart(call, registry.get("attention", "triton").at(config["attention"]),
                       registry.get("attn_out", "triton_gemv").at(config["gemv"]))
        assert torch.equal(fused, apart), config


def _without_prefetch(config):
    """attention_out:triton's config of the same tiles as an attention_out:triton_prefetch config."""
    return {**config, "attention": {k: v for k, v in config["attention"].items() if k != "PREFETCH_V"}}


@triton_only
@pytest.mark.parametrize("layer", ["sliding", "full"])
def test_triton_prefetch_is_bitwise_triton(layer):
    """attention_out:triton_prefetch's decode (each split's first block loaded before the PDL wait, off on
    the CPU) gives attention_out:triton's bits at the same tiles, at decode and prefill."""
    from workbench.variants.attention_out.triton_prefetch import CONFIGS

    # decode: K and V prefetched, then only K (the third config is the second's tiles with both);
    # prefill is attention_out:triton's own code: one layer kind
    cases = [(DECODE.with_(layer=layer), c) for c in CONFIGS[:2]]
    cases += [(PREFILL, CONFIGS[0])] if layer == "sliding" else []
    for wl, config in cases:
        call = _call(wl, seed=4)
        want = registry.get("attention_out", "triton").at(_without_prefetch(config))
        got = registry.get("attention_out", "triton_prefetch").at(config)
        assert torch.equal(got(*call.args, **call.kwargs), want(*call.args, **call.kwargs)), (wl.label(), config)


@triton_only
@pytest.mark.parametrize("layer", ["sliding", "full"])
def test_triton_widemerge_is_triton_prefetch_up_to_the_merges_summation_order(layer):
    """attention_out:triton_widemerge: the prefetch decode kernel's partials, merged in one round trip:
    attention_out:triton_prefetch's output within a rounding of the model dtype at decode (the splits
    summed in another order), its bits at prefill (attention_out:triton's code in both)."""
    from workbench.variants.attention_out.triton_widemerge import CONFIGS

    cases = [(DECODE.with_(layer=layer), c) for c in CONFIGS]
    cases += [(PREFILL, CONFIGS[0])] if layer == "sliding" else []
    for wl, config in cases:
        call = _call(wl, seed=4)
        want = registry.get("attention_out", "triton_prefetch").at(config)(*call.args, **call.kwargs)
        got = registry.get("attention_out", "triton_widemerge").at(config)(*call.args, **call.kwargs)
        if wl is PREFILL:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=8e-3, atol=8e-3)


# ---- on the GPU: the TP8 rank's shapes, PDL, a CUDA graph ------------------------------------------

def _tp8(layer, context, batch=1):
    wl = Workload(preset="beam-501b-tp8", batch=batch, context=context, layer=layer)
    return wl, spec("attention_out").make_inputs(wl, "cuda", 0)


@pytest.mark.gpu
@pytest.mark.parametrize("layer, context, batch", [("sliding", 4096, 1), ("full", 4096, 1), ("full", 32768, 1),
                                                   ("sliding", 4096, 8)])
def test_gpu_tp8_bitwise_apart(layer, context, batch):
    from workbench.variants.attention_out.triton import CONFIGS

    _, call = _tp8(layer, context, batch)
    for config in CONFIGS + [dict(c, pdl=True) for c in CONFIGS]:
        fused = registry.get("attention_out", "triton").at(config)(*call.args, **call.kwargs)
        pdl = {"pdl": True} if config.get("pdl") else {}
        apart = _apart(call, registry.get("attention", "triton").at({**config["attention"], **pdl}),
                       registry.get("attn_out", "triton_gemv").at({**config["gemv"], **pdl}))
        assert torch.equal(fused, apart), config


@pytest.mark.gpu
@pytest.mark.parametrize("layer, context", [("sliding", 4096), ("full", 4096), ("full", 32768)])
def test_gpu_tp8_prefetch_is_bitwise_triton(layer, context):
    from workbench.variants.attention_out.triton_prefetch import CONFIGS

    _, call = _tp8(layer, context)
    for config in CONFIGS + [dict(c, pdl=True) for c in CONFIGS]:
        want = registry.get("attention_out", "triton").at(_without_prefetch(config))(*call.args, **call.kwargs)
        got = registry.get("attention_out", "triton_prefetch").at(config)(*call.args, **call.kwargs)
        assert torch.equal(got, want), config


@pytest.mark.gpu
@pytest.mark.parametrize("variant, config", [("triton", 0), ("triton_merged", 0), ("triton_merged", 2),
                                             ("triton_prefetch", 0), ("triton_prefetch", 1),
                                             ("triton_widemerge", 0), ("triton_widemerge", 1)])
def test_gpu_cuda_graph(variant, config):
    """With PDL, in a CUDA graph, on q and g written after the capture: as eager (triton_merged: one
    head group and two)."""
    _, call = _tp8("sliding", 4096)
    fn = registry.get("attention_out", variant)
    fn = fn.at(dict(fn.configs[config], pdl=True))
    fn(*call.args, **call.kwargs)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fn(*call.args, **call.kwargs)
    q, g = call.args[0], call.args[3]
    q.copy_(torch.randn_like(q)), g.copy_(torch.randn_like(g))
    graph.replay()
    assert torch.equal(y, fn(*call.args, **call.kwargs))
