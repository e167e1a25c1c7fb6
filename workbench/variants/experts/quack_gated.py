"""`experts:quack_gated`: experts:quack with gate and up in one GEMM: quack's gated grouped GEMM
(`gemm_act`, SwiGLU epilogue) over one [gate; up] weight per expert, then quack's down GEMM and
experts:grouped_mm's combine.

The gated GEMM reads each routed pair's input row once (through its token index, quack's gather of
A) for both halves and writes only the activation; experts:quack's two GEMMs read the rows twice and
write gate and up for a SwiGLU kernel. It needs gate and up of an expert in one tensor: a load-time
weight-layout transform (`gate_up_in_one`) moves them into one [experts, 2 x ff, hidden] storage and
re-points the model's gate_proj and up_proj at its two halves, so the weights are held once (a TP8
rank has no room for a second copy of its experts) and every other experts variant still reads
gate_proj and up_proj as before (strided views: the Triton kernels take strides).

Rounding: the activation is silu(gate) * up from the FP32 accumulators, rounded once to the model
dtype (the reference rounds gate and up to the model dtype first); each pair's down projection in
the model dtype; the combine FP32, rounded once.

Prefill sizes only (>= `quack_moe.MIN_TOKENS` tokens), bf16/fp16, Hopper, quack-kernels installed, as
experts:quack; and the CUTLASS DSL imported from a site-packages folder (see `_dsl_keyable`). Never
holds a second copy of the weights nor changes their values (docs/decisions.md #24).
"""

import functools
import importlib.util

import torch

from workbench.registry import register
from workbench.variants.kernels.quack_moe import gemm_config, grouped_gemm, quack_limits, sort_pairs

# gated: M x N tile over the [gate; up] columns (N a multiple of 32 for the gated epilogue), pingpong,
# CTA cluster along M, quack's dynamic persistent scheduler; down: as experts:quack's. On the H200 the
# gated GEMM is fastest at 128 x 160 pingpong in 2-CTA clusters on the dynamic scheduler, the down GEMM
# (K = ff = 320) at 128 x 192 pingpong without a cluster (docs/variants.md, `experts`); the other three
# time each of those two choices against its alternative.
CONFIGS = [
    dict(gu_m=128, gu_n=160, gu_pingpong=True, gu_cluster_m=2, gu_dynamic=True, down_m=128, down_n=192,
         down_pingpong=True, down_cluster_m=1),
    dict(gu_m=128, gu_n=160, gu_pingpong=True, gu_cluster_m=2, gu_dynamic=True, down_m=128, down_n=256,
         down_pingpong=False, down_cluster_m=1),
    dict(gu_m=128, gu_n=160, gu_pingpong=True, gu_cluster_m=2, gu_dynamic=False, down_m=128, down_n=192,
         down_pingpong=True, down_cluster_m=1),
    dict(gu_m=128, gu_n=160, gu_pingpong=True, gu_cluster_m=2, gu_dynamic=False, down_m=128, down_n=256,
         down_pingpong=False, down_cluster_m=1),
]


def _dsl_keyable() -> bool:
    """quack caches a compiled epilogue under a key made from the source and globals of every function it
    calls, except code installed under a site-packages or dist-packages folder, keyed by name. The
    CUTLASS DSL's functions hold a ContextVar, which has no key: imported from any other folder (an
    unpacked bundle, a source checkout) the gated GEMM raises TypeError before it compiles."""
    spec = importlib.util.find_spec("cutlass")
    origin = (spec.origin or "") if spec else ""
    return "/site-packages/" in origin or "/dist-packages/" in origin


def _supports(wl):
    verdict = quack_limits(wl)
    if verdict is not True:
        return verdict
    if not _dsl_keyable():
        return ("quack's gated epilogue compiles only with the CUTLASS DSL imported from a site-packages "
                "folder (quack keys code elsewhere by its globals, and the DSL's hold a ContextVar)")
    return True


def _halves_of_one(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """The [experts, 2 x ff, hidden] tensor gate and up are the two halves of, or None when they are not."""
    e, f, h = gate.shape
    one = (2 * f * h, h, 1)
    if up.shape != gate.shape or gate.stride() != one or up.stride() != one or up.dtype != gate.dtype \
            or up.untyped_storage().data_ptr() != gate.untyped_storage().data_ptr() \
            or up.storage_offset() != gate.storage_offset() + f * h:
        return None
    return gate.as_strided((e, 2 * f, h), one)


def gate_up_in_one(w: dict) -> dict:
    """Weight-layout transform (load time): gate and up moved into one [experts, 2 x ff, hidden] storage,
    gate_proj and up_proj re-pointed in place at its halves (the old storages are freed when nothing
    else holds them: one layer's gate and up of extra memory at a time). Idempotent: weights already
    in this layout are used as they are."""
    gate, up = w["gate_proj"], w["up_proj"]
    merged = _halves_of_one(gate, up)
    if merged is None:
        e, f, h = gate.shape
        merged = torch.empty((e, 2 * f, h), dtype=gate.dtype, device=gate.device)
        merged[:, :f] = gate
        merged[:, f:] = up
        with torch.no_grad():
            gate.set_(merged.untyped_storage(), 0, (e, f, h), merged.stride())
            up.set_(merged.untyped_storage(), f * h, (e, f, h), merged.stride())
    return {**w, "gate_up": merged}


def gated_gemm(x, gate_up, cu_seqlens, a_idx, config):
    """act[r] = silu(g) * u with [g | u] = x[a_idx[r]] @ gate_up[e].T for the rows r of group e, FP32
    accumulation and activation, rounded once to x's dtype."""
    from quack.gemm_interface import gemm_act

    return gemm_act(x, gate_up.transpose(1, 2), activation="swiglu", cu_seqlens_m=cu_seqlens, A_idx=a_idx,
                    store_preact=False, concat_layout=("B",), tuned=False,
                    config=gemm_config(*config))[1]


def _experts_at(x, ids, weights, w, *, gu_m, gu_n, gu_pingpong, gu_cluster_m, gu_dynamic, down_m, down_n,
                down_pingpong, down_cluster_m):
    from workbench.variants.kernels.moe_grouped_mm import combine_sorted

    n, top_k = ids.shape
    if n == 0:
        return torch.empty_like(x)
    cu_seqlens, tokens, pos = sort_pairs(ids, w["gate_up"].shape[0])
    act = gated_gemm(x.contiguous(), w["gate_up"], cu_seqlens, tokens,
                     (gu_m, gu_n, gu_pingpong, gu_cluster_m, gu_dynamic))
    down = grouped_gemm(act, w["down_proj"], cu_seqlens, (down_m, down_n, down_pingpong, down_cluster_m))
    return combine_sorted(down, pos, weights.contiguous().float(), top_k)


@register("experts", "quack_gated", "cute", prepare=gate_up_in_one, supports=_supports, configs=CONFIGS,
          configure=lambda cfg: functools.partial(_experts_at, **cfg))
def experts_quack_gated(x, ids, weights, w):
    """CONFIGS[0]."""
    return _experts_at(x, ids, weights, w, **CONFIGS[0])
