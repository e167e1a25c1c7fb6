"""`experts:flashinfer` and `experts:flashinfer_down` without the library. Stand-ins of FlashInfer's two
SM90 CuTe-DSL MoE GEMMs follow their documented contracts (GEMM1: rows of tile t below
`tile_idx_to_mn_limit[t]` are valid, each gathers input row `token_id_mapping[row] // topk`, w1
[E, 2 x ff, hidden] holds up and gate interleaved in 32-row blocks, up first, SwiGLU from FP32
accumulators rounded to the model dtype; GEMM2: each valid row's down projection, rounded, written
unscaled at its pair's row; tiles past `num_non_exiting_tiles` never run) and drive the adapters,
their routing maps (made in torch, or experts:triton's grouping read as such) and experts:triton's
combine through the op gate. Planted faults (gate packed first, a tile limit one row short or long)
are rejected. The real kernels' op gate: test_every_variant.py, on the GPU."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests.variants.helpers import (
    assert_every_config_passes,
    failures,
    stand_in_flashinfer,
    with_config,
)
from workbench import gates, registry
from workbench.points import Workload
from workbench.variants.experts import flashinfer as fi_moe
from workbench.variants.experts import flashinfer_down as fi_down
from workbench.variants.kernels import flashinfer_moe as fi_kernels

PREFILL = Workload("beam-tiny", batch=2, tokens_per_seq=512, context=512, dtype="bf16")
SMALL = Workload("beam-tiny", batch=2, tokens_per_seq=24, context=24, dtype="bf16")  # MIN_TOKENS lowered for it


def _live_rows(tile_expert, row_limit, num_tiles, tile, rows):
    """(row, expert) of every valid row, as the kernels walk them: tiles past num_tiles never run."""
    row = torch.arange(rows)
    t = row // tile
    live = (t < int(num_tiles[0])) & (row < row_limit.long()[t])
    return row[live], tile_expert.long()[t[live]]


def _gemm1(x, w1, tile_expert, row_limit, token_id_mapping, num_tiles, out=None, *, topk, permuted_m,
           tile_shape_mn, swizzle_size=1, enable_pdl=True, **_):
    assert x.is_contiguous() and w1.stride(2) == 1 and token_id_mapping.numel() == permuted_m
    assert all(t.dtype == torch.int32 for t in (tile_expert, row_limit, token_id_mapping, num_tiles))
    e, two_ff, h = w1.shape
    blocks = w1.view(e, two_ff // 64, 2, 32, h)
    up, gate = (blocks[:, :, i].reshape(e, two_ff // 2, h).float() for i in (0, 1))
    out = torch.full((permuted_m, two_ff // 2), float("nan"), dtype=x.dtype) if out is None else out
    row, j = _live_rows(tile_expert, row_limit, num_tiles, tile_shape_mn[0], permuted_m)
    xr = x[token_id_mapping.long()[row] // topk].float()[:, None, :]  # FP32 accumulation below
    out[row] = (F.silu((gate[j] * xr).sum(-1)) * (up[j] * xr).sum(-1)).to(x.dtype)
    return out


def _gemm2(a, w2, tile_expert, row_limit, row_pair, num_tiles, scales, out, *, topk, use_fused_finalize=True,
           tile_shape_mn, cluster_shape_mn=(1, 1), enable_pdl=True, **_):
    assert not use_fused_finalize and out.shape[0] == scales.numel()
    row, j = _live_rows(tile_expert, row_limit, num_tiles, tile_shape_mn[0], row_pair.numel())
    out[row_pair.long()[row]] = (w2[j].float() * a[row].float()[:, None, :]).sum(-1).to(out.dtype)
    return out


@pytest.fixture
def stand_in(monkeypatch):
    """The FlashInfer modules the adapters import, holding the stand-ins."""
    for name, fn in (("sm90_contiguous_gather_grouped_gemm_act_fusion", _gemm1),
                     ("sm90_contiguous_grouped_gemm_finalize_fusion", _gemm2)):
        stand_in_flashinfer(monkeypatch, f"fused_moe.cute_dsl.{name}", **{name: fn})
    monkeypatch.setattr(fi_kernels, "_cutlass_installed", lambda: True)
    for module in (fi_moe, fi_down):  # the interpreted kernels are slow at 1024 tokens
        monkeypatch.setattr(module, "MIN_TOKENS", SMALL.tokens)


def _on_cpu(v):
    return dataclasses.replace(v, backend="torch")  # the stand-ins run where the real kernels cannot


def _gate(v):
    return gates.op_gate(_on_cpu(v), [SMALL], device="cpu", seeds=(0,))


def test_interleave_puts_each_up_block_before_its_gate_block():
    gate = torch.arange(2 * 64 * 3).view(2, 64, 3)
    up = -gate
    w1 = fi_moe.interleave_up_gate(gate, up)
    assert w1.shape == (2, 128, 3)
    assert torch.equal(w1[:, 0:32], up[:, 0:32]) and torch.equal(w1[:, 32:64], gate[:, 0:32])
    assert torch.equal(w1[:, 64:96], up[:, 32:64]) and torch.equal(w1[:, 96:128], gate[:, 32:64])
    with pytest.raises(ValueError, match="multiple of 32"):
        fi_moe.interleave_up_gate(gate[:, :48], up[:, :48])


def _triton_grouping(ids, experts, tile):
    from workbench.variants.kernels.moe import align_by_expert

    return fi_down.routing_of(*align_by_expert(ids.int(), experts, tile), ids.numel(), experts, tile)


@pytest.mark.parametrize("make", [fi_moe.sort_by_expert, _triton_grouping], ids=["torch", "triton_align"])
@pytest.mark.parametrize("tokens,top_k,experts,tile", [(40, 4, 16, 8), (3, 2, 16, 4), (1, 8, 8, 128), (64, 8, 256, 16)])
def test_routing_maps_place_every_pair_once_in_its_experts_tiles(make, tokens, top_k, experts, tile):
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    ids[: tokens // 2, 0] = 1  # one crowded expert: several tiles
    r = make(ids, experts, tile)
    assert r.rows >= fi_moe.max_tiles(tokens * top_k, experts, tile) * tile
    row, expert = _live_rows(r.tile_expert, r.tile_row_limit, r.num_tiles, tile, r.rows)
    pairs = r.row_pair.long()[row]
    assert sorted(pairs.tolist()) == list(range(tokens * top_k))  # each pair exactly once
    assert torch.equal(ids.reshape(-1)[pairs], expert)  # in a tile of its expert
    counts = torch.bincount(ids.view(-1), minlength=experts)
    assert int(r.num_tiles[0]) == int(((counts + tile - 1) // tile).sum())
    in_use = r.row_pair[: int(r.num_tiles[0]) * tile]  # rows past the tiles in use are never read
    assert (in_use == -1).sum() == in_use.numel() - tokens * top_k  # padding rows hold -1


def test_every_config_passes_the_op_gate_through_the_stand_ins(stand_in):
    # the (1, 2) cluster runs at none of beam-tiny's shapes: the GPU test gates it at beam-501b-tp8
    assert_every_config_passes(_on_cpu(registry.get("experts", "flashinfer")), [SMALL], device="cpu", seeds=(0,))


def test_a_cluster_pair_needs_an_even_count_of_n_tiles():
    v = registry.get("experts", "flashinfer")
    pair = next(c for c in v.configs if c["cluster_n"] == 2)
    assert "even count" in v.unsupported_config(pair, PREFILL)  # beam-tiny: hidden 64, one N tile
    assert v.unsupported_config(pair, PREFILL.with_(preset="beam-501b-tp8")) is None


def test_hybrid_every_config_passes_the_op_gate_through_the_stand_in(stand_in):
    assert_every_config_passes(_on_cpu(registry.get("experts", "flashinfer_down")), [SMALL], device="cpu",
                               seeds=(0,))


def test_hybrid_gate_rejects_a_tile_limit_one_row_long(stand_in, monkeypatch):
    real = fi_down.routing_of

    def long(*args):
        r = real(*args)
        return dataclasses.replace(r, tile_row_limit=r.tile_row_limit + 1)  # a padding row (-1) computed

    monkeypatch.setattr(fi_down, "routing_of", long)
    assert not _gate(registry.get("experts", "flashinfer_down")).passed


def test_gate_rejects_gate_and_up_packed_the_wrong_way_round(stand_in, monkeypatch):
    real = fi_moe.interleave_up_gate
    monkeypatch.setattr(fi_moe, "interleave_up_gate", lambda gate, up: real(up, gate))
    report = _gate(registry.get("experts", "flashinfer"))
    assert not report.passed and any(c.name == "accuracy" for c in report.failures), failures(report)


def test_gate_rejects_a_routing_map_one_row_short(stand_in, monkeypatch):
    real = fi_moe.sort_by_expert

    def short(ids, num_experts, tile):
        r = real(ids, num_experts, tile)
        return dataclasses.replace(r, tile_row_limit=r.tile_row_limit - 1)  # each expert's last pair dropped

    monkeypatch.setattr(fi_moe, "sort_by_expert", short)
    assert not _gate(registry.get("experts", "flashinfer")).passed


def test_supports_names_why_it_declines(monkeypatch):
    v = registry.get("experts", "flashinfer")
    monkeypatch.setattr(fi_kernels, "_cutlass_installed", lambda: False)
    assert "CUTLASS DSL" in v.supports(PREFILL)
    monkeypatch.setattr(fi_kernels, "_cutlass_installed", lambda: True)
    assert v.supports(PREFILL) is True
    assert "prefill sizes" in v.supports(Workload("beam-501b-tp8", batch=64))
    assert "bf16 or fp16" in v.supports(PREFILL.with_(dtype="fp32"))
    odd = with_config(PREFILL, moe_intermediate_size=48)
    assert "multiple of 32" in v.supports(odd)
    hybrid = registry.get("experts", "flashinfer_down")  # no interleave: ff need only make 16-byte rows
    assert hybrid.supports(odd) is True and hybrid.supports(PREFILL) is True
    assert "prefill sizes" in hybrid.supports(Workload("beam-501b-tp8", batch=64))

