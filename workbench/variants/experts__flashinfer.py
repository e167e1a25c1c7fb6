"""`experts:flashinfer`: FlashInfer's SM90 CuTe-DSL fused MoE (`cute_dsl_fused_moe_bf16`).

Three stages, all FlashInfer's: `moe_sort` (routing index maps on the device), GEMM1 (gather of each
pair's input row, grouped warp-specialised TMA GEMM, SwiGLU in the epilogue) and GEMM2 (grouped GEMM
scattering each pair's unscaled down projection), then `moe_unpermute` (the weighted FP32 combine in
a fixed order, rounded once). `use_fused_finalize=False` keeps it deterministic: the fused finalize
accumulates in the model dtype with atomics, which the op gate's same-input-twice check rejects.

Rounding against the reference: the combine is the reference's (FP32, rounded once) and each pair's
down projection is rounded to the model dtype as there; the SwiGLU takes gate and up from the FP32
accumulators rather than rounded to the model dtype first (as experts:triton's grouped path does).

GEMM1 takes gate and up as one [experts, 2 x ff, hidden] weight, up and gate interleaved in blocks of
32 rows. The model holds them apart and a packed copy of every MoE layer would not fit beside a TP8
rank's weights, so each call repacks the layer's gate and up into one scratch buffer. That moves all
experts' gate/up weights per call, which only a prefill's GEMMs amortise: calls under MIN_TOKENS
tokens are declined (experts:triton / triton_rows serve decode).

Backend `flashinfer` plus the CUTLASS DSL package (`cutlass`), an SM90 GPU (the kernels are Hopper
only), BF16/FP16 weights, ff a multiple of 32 and hidden of 8 (the kernels' constraints).
"""

import functools
import importlib.util

import torch

from workbench.registry import register

MIN_TOKENS = 1024
INTERLEAVE = 32  # GEMM1's epilogue pairs up row block j with the gate row block after it

# A config is one FlashInfer "tactic": the M tile (also moe_sort's), GEMM1's N tile and persistent-walk
# swizzle, GEMM2's N tile and CTA cluster along N ((1, 2) multicasts the intermediate). The first is
# FlashInfer's default tactic; each costs two CuTe DSL compiles on first use.
CONFIGS = [
    dict(tile=128, gemm1_n=64, swizzle=1, gemm2_n=64, cluster_n=1),
    dict(tile=128, gemm1_n=128, swizzle=1, gemm2_n=128, cluster_n=1),
    dict(tile=128, gemm1_n=256, swizzle=8, gemm2_n=256, cluster_n=1),
    dict(tile=128, gemm1_n=128, swizzle=8, gemm2_n=128, cluster_n=2),
]


def tactic(tile, gemm1_n, swizzle, gemm2_n, cluster_n):
    """A config as FlashInfer's tactic tuple: (tile, (GEMM1 tile, swizzle), (GEMM2 tile, cluster, raster))."""
    return (tile, ((tile, gemm1_n), swizzle), ((tile, gemm2_n), (1, cluster_n), False))


def interleave_up_gate(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[E, 2 x ff, hidden] with rows [up 0:32, gate 0:32, up 32:64, gate 32:64, ...], GEMM1's layout."""
    e, ff, h = gate.shape
    if up.shape != gate.shape or ff % INTERLEAVE:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must match, ff a multiple of "
                         f"{INTERLEAVE}")
    out = torch.empty((e, 2 * ff, h), dtype=gate.dtype, device=gate.device) if out is None else out
    blocks = out.view(e, ff // INTERLEAVE, 2, INTERLEAVE, h)
    blocks[:, :, 0].copy_(up.view(e, ff // INTERLEAVE, INTERLEAVE, h))
    blocks[:, :, 1].copy_(gate.view(e, ff // INTERLEAVE, INTERLEAVE, h))
    return out


def _cutlass_installed() -> bool:
    return importlib.util.find_spec("cutlass") is not None


def _supports(wl):
    c = wl.config
    if not _cutlass_installed():
        return "cute_dsl_fused_moe_bf16 needs the CUTLASS DSL package ('cutlass'), which is not installed"
    if wl.dtype not in ("bf16", "fp16"):
        return f"cute_dsl_fused_moe_bf16 takes bf16 or fp16, not {wl.dtype}"
    if c.moe_intermediate_size % INTERLEAVE or c.hidden_size % 8:
        return (f"ff {c.moe_intermediate_size} must be a multiple of {INTERLEAVE} and hidden {c.hidden_size} "
                "of 8 (cute_dsl_fused_moe_bf16)")
    if wl.tokens < MIN_TOKENS:
        return (f"{wl.tokens} tokens: the per-call gate/up repack only pays at prefill sizes "
                f"(>= {MIN_TOKENS} tokens)")
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9:
        major, minor = torch.cuda.get_device_capability()
        return f"cute_dsl_fused_moe_bf16 runs on SM90 (Hopper) only, not sm_{major}{minor}"
    return True


def _experts_at(x, ids, weights, w, **config):
    from flashinfer.fused_moe import cute_dsl_fused_moe_bf16

    n, top_k = ids.shape
    if n == 0:
        return torch.empty_like(x)
    num_experts = w["gate_proj"].shape[0]
    return cute_dsl_fused_moe_bf16(
        x.contiguous(), ids.to(torch.int32), weights.float().contiguous(),
        interleave_up_gate(w["gate_proj"], w["up_proj"]), w["down_proj"],
        num_experts=num_experts, top_k=top_k, use_fused_finalize=False, enable_pdl=False,
        tactic=tactic(**config))


@register("experts", "flashinfer", "flashinfer", supports=_supports, configs=CONFIGS,
          configure=lambda cfg: functools.partial(_experts_at, **cfg))
def experts_flashinfer(x, ids, weights, w):
    """FlashInfer's default tactic."""
    return _experts_at(x, ids, weights, w, **CONFIGS[0])
