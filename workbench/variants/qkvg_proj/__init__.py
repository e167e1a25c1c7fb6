"""`qkvg_proj`: the attention sub-layer's input projections.

Contract: `qkvg_proj(x, w) -> (q, k, v, g)`; x [N, hidden]; w {"q_proj", "k_proj", "v_proj",
"gate_proj"} as [out, in] matrices; q and g [N, heads*head_dim], k and v [N, kv_heads*head_dim],
all in the model dtype (GEMMs accumulate in FP32, round once).
"""

import torch.nn.functional as F

from workbench.points import Call, PointSpec, declare
from workbench.registry import register
from workbench.variants.inputs import DTYPE_BYTES, Rand


@register("qkvg_proj", "torch", "torch")
def qkvg_proj(x, w):
    return F.linear(x, w["q_proj"]), F.linear(x, w["k_proj"]), F.linear(x, w["v_proj"]), F.linear(x, w["gate_proj"])


# ---- spec: inputs, roofline and tolerance for the harness ------------------------------------------


def _inputs(wl, device, seed):
    c, r = wl.config, Rand("qkvg_proj", wl, device, seed)
    h = c.hidden_size
    w = {"q_proj": r.linear(c.q_width, h), "k_proj": r.linear(c.kv_width, h), "v_proj": r.linear(c.kv_width, h),
         "gate_proj": r.linear(c.q_width, h)}
    return Call((r.normal(wl.tokens, h), w), weights_arg=1)


def _out_width(c):
    return 2 * c.q_width + 2 * c.kv_width


declare(PointSpec(
    "qkvg_proj", _inputs,
    bytes=lambda wl: DTYPE_BYTES[wl.dtype] * (wl.tokens + _out_width(wl.config)) * wl.config.hidden_size
    + DTYPE_BYTES[wl.dtype] * wl.tokens * _out_width(wl.config),
    flops=lambda wl: 2 * wl.tokens * wl.config.hidden_size * _out_width(wl.config),
    tolerance={"fp32": 1e-5, "fp16": 8e-4, "bf16": 6e-3},  # ~2.5x the reference's worst vs FP64
))



# ---- packed variants: one weight stream for all four projections ------------------------------------

import functools  # noqa: E402

import torch  # noqa: E402

try:  # the Triton variant is registered either way; the registry reports a missing triton
    from workbench.variants.kernels import gemv as _triton_gemv
except ImportError:
    _triton_gemv = None

_PARTS = ("q_proj", "k_proj", "v_proj", "gate_proj")


def pack_qkvg(w):
    """Weight-layout transform (load time): q, k, v and gate stacked into one [q+k+v+gate, hidden]
    matrix, so one GEMM reads x once and the weights as one stream. Costs a second copy of these
    weights while the model keeps its separate ones."""
    return {"qkvg": torch.cat([w[p] for p in _PARTS]).contiguous(), "sizes": tuple(w[p].shape[0] for p in _PARTS)}


@register("qkvg_proj", "packed", "torch", prepare=pack_qkvg)
def qkvg_packed(x, w):
    """One GEMM on the packed weight. Column slices of its [N, total] output are contiguous only for
    N = 1 (free views); for N > 1 one split-copy makes the four contiguous outputs."""
    y = F.linear(x, w["qkvg"])
    if y.shape[0] == 1:
        return tuple(t.view(1, -1) for t in y.view(-1).split(w["sizes"]))
    outs = [y.new_empty(y.shape[0], s) for s in w["sizes"]]
    torch.split_with_sizes_copy(y, list(w["sizes"]), dim=1, out=outs)
    return tuple(outs)


from workbench.variants.kernels.triton_common import gemv_config as _cfg  # noqa: E402

# Tuned for TP8 (5120 -> 1792 rows): FMA GEMVs for M = 1-4 (224-560 CTAs, so 132 SMs keep enough
# weight loads in flight), tl.dot with M padded to 16 for M = 8-16, tiled tl.dot for M = 64 and prefill.
GEMV_CONFIGS = [
    _cfg(8, 512), _cfg(8, 1024, warps=8), _cfg(4, 1024), _cfg(16, 512, split_k=2, warps=8),
    _cfg(16, 256, split_k=4), _cfg(16, 1024, split_k=5, warps=8),
    _cfg(16, 256, split_k=2, stages=4, dot=True), _cfg(32, 128, split_k=4, stages=4, dot=True),
    _cfg(32, 128, split_k=4, stages=3, bm=64, dot=True), _cfg(64, 64, split_k=8, stages=4, bm=64, dot=True),
    _cfg(128, 64, warps=8, stages=3, bm=128, dot=True),
]


def supports_triton(wl):
    if wl.dtype not in ("bf16", "fp16", "fp32"):
        return f"the Triton GEMV takes bf16/fp16/fp32 weights, not {wl.dtype}"
    return True  # any M: configs with BLOCK_M 64/128 are the tiled path; the harness times them all


def _prepare_triton(w):
    return {**pack_qkvg(w), "locks": _triton_gemv.new_locks(w["q_proj"].device)}


@register("qkvg_proj", "triton", "triton", prepare=_prepare_triton, supports=supports_triton,
          configs=GEMV_CONFIGS, pdl=True, configure=lambda cfg: functools.partial(qkvg_triton, cfg=cfg))
def qkvg_triton(x, w, cfg=GEMV_CONFIGS[0]):
    """The packed weight through the Triton GEMV; the kernel writes q, k, v, g segment-major into one
    buffer, so all four outputs are contiguous without a copy."""
    return _triton_gemv.linear(x, w["qkvg"], cfg, w["locks"], splits=w["sizes"])


# ---- CuTe DSL GEMV: decode (1-16 tokens) on the packed weight ----------------------------------------

# The kernel (workbench/variants/kernels/cute_gemv.py) imports cutlass, so it is imported by the variant's
# first call; the variant is registered either way and the registry reports the backend as unavailable.
from workbench.variants.kernels.cute_common import vector_rows_supported  # noqa: E402

_CUTE_MAX_TOKENS = 16  # the per-lane FP32 sums (tokens x rows per warp) are registers
# W rows per warp, warps per CTA, W vectors per lane per step. At TP8 (1792 x 5120) a lane has 20
# vectors of each row; W loads in flight per lane = rows x unroll (twice that across the pipelined
# step), CTAs = 1792 / (rows x warps). Each compiles for sm_90a without local-memory spills at TP8 for
# 1-16 tokens (rows_per_warp 1 with unroll 5, 10 or 20 did not: ptxas held those to 48-80 registers and spilled).
CUTE_GEMV_CONFIGS = [
    {"rows_per_warp": 2, "num_warps": 4, "unroll": 5},
    {"rows_per_warp": 2, "num_warps": 2, "unroll": 5},
    {"rows_per_warp": 4, "num_warps": 2, "unroll": 4},
]


def _qkvg_cute_at(x, w, **cfg):
    """Decode rows (at most _CUTE_MAX_TOKENS) through the CuTe GEMV; a prompt's rows through one GEMM
    on the same packed weight (`packed`), so a decode-searched lock also serves prefill steps."""
    if x.shape[0] > _CUTE_MAX_TOKENS:
        return qkvg_packed(x, w)
    from workbench.variants.kernels import cute_gemv as _cute_gemv

    return _cute_gemv.linear(x, w["qkvg"], w["sizes"], **cfg)


@register("qkvg_proj", "cute", "cute", prepare=pack_qkvg, supports=vector_rows_supported, configs=CUTE_GEMV_CONFIGS,
          configure=lambda cfg: functools.partial(_qkvg_cute_at, **cfg))
def qkvg_cute(x, w):
    """The packed weight through the CuTe DSL GEMV; q, k, v, g written segment-major into one buffer,
    so all four outputs are contiguous views, as the Triton variant returns them."""
    return _qkvg_cute_at(x, w, **CUTE_GEMV_CONFIGS[0])
